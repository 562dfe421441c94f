//! ferry's eBPF data plane (placeholder until the loader lands).
