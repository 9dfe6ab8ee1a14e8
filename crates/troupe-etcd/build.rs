//! Checks that the protoc `scripts/protoc` runs for etcd-client's build is there: the
//! binary of the protoc-bin-vendored crate for this machine (see .cargo/config.toml).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if let Err(error) = protoc_bin_vendored::protoc_bin_path() {
        println!("cargo:warning=protoc-bin-vendored has no protoc for this machine ({error}); etcd-client's build needs a protoc on PATH or in PROTOC");
    }
}
