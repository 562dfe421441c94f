fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "ferry/v1/common.proto",
        "ferry/v1/control.proto",
        "ferry/v1/peer.proto",
        "ferry/v1/balance.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure()
        .file_descriptor_set_path(
            std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("ferry_v1_descriptor.bin"),
        )
        .compile_protos(&protos, &["."])?;
    Ok(())
}
