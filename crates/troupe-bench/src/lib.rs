//! Troupe's benchmarks, as a package of their own (no library code): the criterion
//! benches are under `benches/` at the repository root and run with
//! `cargo bench -p troupe-bench --bench NAME`. See the package's `Cargo.toml` for why.
