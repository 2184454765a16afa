//! TLS of a pool client's own transfer engine (issue 15), read from the environment by every
//! process that moves KV bytes to and from the agents itself (the Python package, the store
//! bench, `kvpool up`'s children): `KVPOOL_TRANSFER_TLS` (`off`, `allow`, `require`),
//! `KVPOOL_TRANSFER_CA_FILE` (the CA that verifies the agents) and
//! `KVPOOL_TRANSFER_SERVER_NAME` (the name their certificates carry; default: their IP
//! address). A client serves no TLS itself: with `allow` it dials plaintext, with `require`
//! TLS only. I/O boundary: the process environment (the CA file is read by the engine).

use std::path::PathBuf;

use kvpool_transfer::{TlsMode, TransferTls};

/// `off`, `allow` or `require` (unset: `off`).
pub const TRANSFER_TLS_ENV: &str = "KVPOOL_TRANSFER_TLS";
/// CA certificates (PEM) that verify the agents' transfer certificates.
pub const TRANSFER_CA_FILE_ENV: &str = "KVPOOL_TRANSFER_CA_FILE";
/// The name the agents' transfer certificates must carry (default: their IP address).
pub const TRANSFER_SERVER_NAME_ENV: &str = "KVPOOL_TRANSFER_SERVER_NAME";

/// A transfer TLS variable with a value that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("invalid transfer TLS setting {variable}: {reason}")]
pub struct TransferTlsError {
    pub variable: &'static str,
    pub reason: String,
}

/// The transfer TLS settings in the process environment.
pub fn transfer_tls_from_env() -> Result<TransferTls, TransferTlsError> {
    transfer_tls_from(|name| std::env::var(name).ok())
}

/// The transfer TLS settings `var` gives (unset or empty variables are not set).
pub fn transfer_tls_from(
    var: impl Fn(&str) -> Option<String>,
) -> Result<TransferTls, TransferTlsError> {
    let get = |name| {
        var(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    let mode = match get(TRANSFER_TLS_ENV).as_deref() {
        None | Some("off") => TlsMode::Off,
        Some("allow") => TlsMode::Allow,
        Some("require") => TlsMode::Require,
        Some(other) => {
            return Err(TransferTlsError {
                variable: TRANSFER_TLS_ENV,
                reason: format!("{other:?} is not one of off, allow, require"),
            });
        }
    };
    let ca_file = get(TRANSFER_CA_FILE_ENV).map(PathBuf::from);
    if mode == TlsMode::Require && ca_file.is_none() {
        return Err(TransferTlsError {
            variable: TRANSFER_CA_FILE_ENV,
            reason: format!(
                "{TRANSFER_TLS_ENV}=require needs it (the CA that verifies the agents)"
            ),
        });
    }
    Ok(TransferTls {
        mode,
        ca_file,
        server_name: get(TRANSFER_SERVER_NAME_ENV),
        ..TransferTls::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Result<TransferTls, TransferTlsError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        transfer_tls_from(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn unset_is_off_and_require_takes_the_ca_and_name() {
        assert_eq!(from(&[]).unwrap(), TransferTls::default());
        let tls = from(&[
            (TRANSFER_TLS_ENV, "require"),
            (TRANSFER_CA_FILE_ENV, "/ca.pem"),
            (TRANSFER_SERVER_NAME_ENV, " agents.kvpool "),
        ])
        .unwrap();
        assert_eq!(tls.mode, TlsMode::Require);
        assert_eq!(tls.ca_file, Some(PathBuf::from("/ca.pem")));
        assert_eq!(tls.server_name.as_deref(), Some("agents.kvpool"));
        assert_eq!(tls.cert_file, None);
    }

    #[test]
    fn bad_values_name_the_variable() {
        let e = from(&[(TRANSFER_TLS_ENV, "yes")]).unwrap_err();
        assert_eq!(e.variable, TRANSFER_TLS_ENV);
        let e = from(&[(TRANSFER_TLS_ENV, "require")]).unwrap_err();
        assert_eq!(e.variable, TRANSFER_CA_FILE_ENV);
        assert!(e.to_string().contains("KVPOOL_TRANSFER_CA_FILE"), "{e}");
    }
}
