//! A CPU-bound workload for the balancing tests: spins forever. `--id N`
//! only tags the command line, so a test can follow one process across
//! migrations (its PID changes with each move).

fn main() {
    let mut x: u64 = std::env::args().count() as u64;
    loop {
        for _ in 0..1_000_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
        }
        std::hint::black_box(x);
    }
}
