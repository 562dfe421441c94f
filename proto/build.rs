fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "ferry/v1/common.proto",
        "ferry/v1/control.proto",
        "ferry/v1/peer.proto",
        "ferry/v1/balance.proto",
        "ferry/v1/groups_api.proto",
        "ferry/v1/groups.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure()
        // Page data as `bytes::Bytes`: decoded as a slice of the message
        // buffer instead of a copy (a post-copy fill's pages pass here).
        .bytes(".ferry.v1.PageRun.data")
        .file_descriptor_set_path(
            std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("ferry_v1_descriptor.bin"),
        )
        .compile_protos(&protos, &["."])?;
    Ok(())
}
