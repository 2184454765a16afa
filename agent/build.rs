//! Generates the engine API's gRPC code from proto/kvpool/agent/v1/engine.proto.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&["proto/kvpool/agent/v1/engine.proto"], &["proto"])?;
    Ok(())
}
