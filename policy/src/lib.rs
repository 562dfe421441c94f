//! Load-balancing policies (seed 000 §IV, seed 002). Pure and deterministic:
//! time and randomness are injected by the caller.
