//! ferryd, the ferry agent.
