//! The master port's TLS configuration, reloaded while the master runs (issue 15): every
//! `--tls-reload-interval` the certificate, key and client CA files are read again; when their
//! content changed (a SHA-256 over the three files: a touch or a rewrite with the same bytes
//! changes nothing, a new certificate with an old mtime still counts) a new rustls
//! `ServerConfig` is built and swapped in. Connections accepted after the swap handshake with
//! it; open ones keep the session they have. Files that cannot be read or do not make a
//! configuration leave the old one serving, are logged with the file and the reason, and are
//! counted once per content in `kvpool_master_tls_reloads_total{result="error"}`.
//! I/O boundary: the PEM files.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::tls::{PemFiles, TlsError, server_config};
use kvpool_runtime::telemetry::chain;

/// Where the port's certificate, key and (for mutual TLS) client CA are read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsPaths {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// What one reload pass did.
#[derive(Debug)]
pub enum Reload {
    /// The files hold what they held at the last pass.
    Unchanged,
    /// A new configuration serves new connections.
    Swapped,
    /// The new content is unusable; the configuration before it still serves.
    Failed(TlsError),
}

/// The port's current TLS configuration and the files it comes from.
#[derive(derive_more::Debug)]
pub struct ReloadingTls {
    paths: TlsPaths,
    #[debug(skip)]
    current: RwLock<Arc<rustls::ServerConfig>>,
    /// Digest of the files at the last pass (served or refused), so that refused content is
    /// logged and counted once, not at every pass.
    #[debug(skip)]
    seen: Mutex<Vec<u8>>,
}

fn digest(pems: &PemFiles<'_>) -> Vec<u8> {
    let mut h = Sha256::new();
    let files = [Some(&pems.cert), Some(&pems.key), pems.client_ca.as_ref()];
    for (_, bytes) in files.into_iter().flatten() {
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.finalize().to_vec()
}

impl ReloadingTls {
    /// Read the files and build the first configuration (an error names the file at fault).
    pub fn load(paths: TlsPaths) -> Result<Self, TlsError> {
        let (config, seen) = {
            let pems = PemFiles::read(&paths.cert, &paths.key, paths.client_ca.as_deref())?;
            (server_config(&pems)?, digest(&pems))
        };
        Ok(Self {
            paths,
            current: RwLock::new(Arc::new(config)),
            seen: Mutex::new(seen),
        })
    }

    /// The acceptor of a new connection: the configuration serving now.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.read().clone())
    }

    pub fn paths(&self) -> &TlsPaths {
        &self.paths
    }

    /// Read the files again and swap in a configuration made from them if they changed.
    pub fn reload(&self) -> Reload {
        let paths = &self.paths;
        let pems = PemFiles::read(&paths.cert, &paths.key, paths.client_ca.as_deref());
        let (pems, now) = match pems {
            Ok(p) => {
                let d = digest(&p);
                (Ok(p), d)
            }
            // An unreadable file (gone during a rotation, no permission) is content of its
            // own: the error's text stands for it.
            Err(e) => {
                let d = Sha256::digest(chain(&e).to_string().as_bytes()).to_vec();
                (Err(e), d)
            }
        };
        let mut seen = self.seen.lock();
        if *seen == now {
            return Reload::Unchanged;
        }
        *seen = now;
        match pems.and_then(|p| server_config(&p)) {
            Ok(config) => {
                *self.current.write() = Arc::new(config);
                Reload::Swapped
            }
            Err(e) => Reload::Failed(e),
        }
    }
}

/// The port's TLS as validated at start-up.
#[derive(Clone, Debug)]
pub struct ServerTls {
    pub config: Arc<ReloadingTls>,
    /// Clients must present a certificate (`--tls-client-ca-file`).
    pub mutual: bool,
    /// How often the files are read again; zero: never.
    pub reload_interval: Duration,
}

impl ServerTls {
    /// Load the files of `paths`, reloaded every `reload_interval` once [`watch`] runs.
    pub fn load(paths: TlsPaths, reload_interval: Duration) -> Result<Self, TlsError> {
        let mutual = paths.client_ca.is_some();
        Ok(Self {
            config: Arc::new(ReloadingTls::load(paths)?),
            mutual,
            reload_interval,
        })
    }

    /// The port's TLS from the `--tls-cert-file`, `--tls-key-file` and
    /// `--tls-client-ca-file` flags: `None` without a certificate and key.
    pub fn from_flags(
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        client_ca: Option<PathBuf>,
        reload_interval: Duration,
    ) -> Result<Option<Self>, TlsError> {
        match (cert, key) {
            (None, None) if client_ca.is_none() => Ok(None),
            (Some(cert), Some(key)) => {
                let paths = TlsPaths {
                    cert,
                    key,
                    client_ca,
                };
                Self::load(paths, reload_interval).map(Some)
            }
            _ => Err(TlsError::Flags),
        }
    }
}

/// `kvpool_master_tls_reloads_total{result}`: `[ok, error]`.
#[derive(Clone, Debug)]
pub struct ReloadCounters([IntCounter; 2]);

impl ReloadCounters {
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let v = IntCounterVec::new(
            Opts::new(
                "kvpool_master_tls_reloads_total",
                "Changed TLS files of the master's port read again, by result (ok: a new \
                 certificate serves new connections; error: the files were refused and the \
                 certificate before them still serves)",
            ),
            &["result"],
        )?;
        registry.register(Box::new(v.clone()))?;
        Ok(Self([
            v.with_label_values(&["ok"]),
            v.with_label_values(&["error"]),
        ]))
    }
}

/// Reload `tls` every `tls.reload_interval` until `stop` (nothing with a zero interval).
pub async fn watch(tls: ServerTls, counters: ReloadCounters, stop: CancellationToken) {
    if tls.reload_interval.is_zero() {
        return;
    }
    let mut every = tokio::time::interval(tls.reload_interval);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    every.tick().await; // the first tick is now: the files were just loaded
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        let config = tls.config.clone();
        let Ok(outcome) = tokio::task::spawn_blocking(move || config.reload()).await else {
            continue;
        };
        let paths = tls.config.paths();
        match outcome {
            Reload::Unchanged => {}
            Reload::Swapped => {
                counters.0[0].inc();
                tracing::info!(
                    cert = %paths.cert.display(),
                    key = %paths.key.display(),
                    client_ca = ?paths.client_ca,
                    "the master port's TLS files changed: new connections use them"
                );
            }
            Reload::Failed(e) => {
                counters.0[1].inc();
                tracing::error!(
                    error = %chain(&e),
                    "the master port's changed TLS files were refused; the certificate \
                     loaded before still serves"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_harness::tls::write_throwaway;

    #[test]
    fn a_reload_swaps_only_changed_content_and_keeps_the_old_config_on_bad_files() {
        let dir = tempfile::tempdir().expect("tmp");
        for sub in ["a", "b"] {
            std::fs::create_dir(dir.path().join(sub)).expect("dir");
        }
        let a = write_throwaway(&dir.path().join("a"), "first CA", &["127.0.0.1"]).expect("a");
        let b = write_throwaway(&dir.path().join("b"), "second CA", &["127.0.0.1"]).expect("b");
        let paths = TlsPaths {
            cert: dir.path().join("cert.pem"),
            key: dir.path().join("key.pem"),
            client_ca: None,
        };
        let copy = |from: &std::path::Path, to: &std::path::Path| {
            std::fs::copy(from, to).expect("copy");
        };
        copy(&a.master_cert, &paths.cert);
        copy(&a.master_key, &paths.key);
        let tls = ReloadingTls::load(paths.clone()).expect("load");
        let first = tls.current.read().clone();
        assert!(matches!(tls.reload(), Reload::Unchanged));
        // The same bytes written again (a new mtime): nothing to do.
        copy(&a.master_cert, &paths.cert);
        assert!(matches!(tls.reload(), Reload::Unchanged));
        assert!(Arc::ptr_eq(&first, &tls.current.read()));
        // A certificate that is not a certificate: refused once, the old config serves.
        std::fs::write(&paths.cert, "not a certificate").expect("write");
        match tls.reload() {
            Reload::Failed(e) => assert!(
                e.to_string().contains("cert.pem") && e.to_string().contains("no PEM"),
                "{e}"
            ),
            other => panic!("{other:?}"),
        }
        assert!(matches!(tls.reload(), Reload::Unchanged), "counted once");
        assert!(Arc::ptr_eq(&first, &tls.current.read()));
        // The new CA's certificate with the old key: refused, naming both files.
        copy(&b.master_cert, &paths.cert);
        let Reload::Failed(e) = tls.reload() else {
            panic!("a key that is not the certificate's was taken");
        };
        assert!(e.to_string().contains("key.pem"), "{e}");
        // A missing key file: refused, naming it.
        std::fs::remove_file(&paths.key).expect("rm");
        let Reload::Failed(e) = tls.reload() else {
            panic!("a missing key was taken");
        };
        assert!(e.to_string().contains("key.pem"), "{e}");
        // Both files of the new CA: swapped.
        copy(&b.master_key, &paths.key);
        assert!(matches!(tls.reload(), Reload::Swapped));
        assert!(!Arc::ptr_eq(&first, &tls.current.read()));
        assert!(matches!(tls.reload(), Reload::Unchanged));
        // Debug names the files only, never the configuration that holds the private key.
        let shown = format!("{tls:?}");
        assert!(shown.contains("key.pem"), "{shown}");
        assert!(!shown.contains("ServerConfig"), "{shown}");
        assert!(shown.ends_with(", .. }"), "{shown}");
    }
}
