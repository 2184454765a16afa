//! The target side of `kvpool bench transfer`: a memfd segment registered with the engine and
//! served over TCP and shared memory; in `--mode target` its address line on stdout, then
//! serving until SIGINT/SIGTERM. I/O boundary: the engine's listeners, stdout, signals.

use std::io::Write as _;
use std::sync::Arc;

use kvpool_transfer::{
    AuthKey, Endpoint, HostOptions, LocalSegment, Segment, SegmentDescriptor, TransferEngine,
};

use super::{TransferBenchArgs, TransferBenchError, new_engine};

pub(super) struct Target {
    _engine: TransferEngine,
    _segment: LocalSegment,
    _tcp: kvpool_transfer::TcpServer,
    _shm: kvpool_transfer::ShmServer,
    pub(super) descriptor: SegmentDescriptor,
}

impl Target {
    pub(super) fn start(
        args: &TransferBenchArgs,
        key: AuthKey,
    ) -> Result<Self, TransferBenchError> {
        let engine = new_engine(args, key)?;
        let size = usize::try_from(args.buffer_size)
            .map_err(|_| TransferBenchError::Args("--buffer-size too large".into()))?;
        let seg = Segment::memfd(&args.segment_id, size, HostOptions::default())
            .map_err(TransferBenchError::Memory)?;
        seg.fill(0, size, 0x5a)
            .map_err(TransferBenchError::Memory)?;
        let segment = engine
            .register(&args.segment_id, Arc::new(seg))
            .map_err(TransferBenchError::Engine)?;
        let tcp = engine
            .listen_tcp(args.listen)
            .map_err(TransferBenchError::Engine)?;
        let shm = engine
            .listen_shm(&args.shm_path())
            .map_err(TransferBenchError::Engine)?;
        let descriptor = engine.describe(
            &segment,
            vec![
                Endpoint::Tcp(tcp.local_addr()),
                Endpoint::Shm(shm.path().to_owned()),
            ],
        );
        Ok(Target {
            _engine: engine,
            _segment: segment,
            _tcp: tcp,
            _shm: shm,
            descriptor,
        })
    }
}

pub(super) fn run_target(args: &TransferBenchArgs) -> Result<(), TransferBenchError> {
    let key = AuthKey::load(args.auth_key_file.as_deref()).map_err(TransferBenchError::Auth)?;
    let target = Target::start(args, key)?;
    let tcp = target.descriptor.tcp_endpoint();
    let shm = target.descriptor.shm_endpoint().cloned();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "kvpool-bench-target tcp={} shm={} segment={} size={}",
        tcp.map(|a| a.to_string()).unwrap_or_default(),
        shm.map(|p| p.display().to_string()).unwrap_or_default(),
        args.segment_id,
        args.buffer_size
    );
    let _ = out.flush();
    drop(out);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(TransferBenchError::Signal)?;
    let limit = match args.duration {
        Some(d) if !d.is_zero() => Some(d),
        _ => None,
    };
    rt.block_on(async {
        let token = tokio_util::sync::CancellationToken::new();
        kvpool_runtime::shutdown::cancel_on_signal(token.clone())
            .map_err(TransferBenchError::Signal)?;
        match limit {
            Some(d) => {
                let _ = tokio::time::timeout(d, token.cancelled()).await;
            }
            None => token.cancelled().await,
        }
        Ok::<_, TransferBenchError>(())
    })?;
    drop(target);
    Ok(())
}
