//! Network-namespace cluster harness (placeholder until it lands).
