//! Throw-away TLS certificates for the master's port and the transfer lanes (`kvpool up --tls`,
//! `kvpool bench master --tls`, the TLS tests): a CA that issues a certificate per process
//! (server, client or both), or at once a master certificate for the names given and a client
//! certificate, made with rcgen into a directory (certificates 0644, keys 0600; the caller's
//! directory should be 0700). Nothing outside that directory trusts the CA. I/O boundary: the
//! files written.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// Errors of making the throw-away certificates.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum TlsGenError {
    #[error("cannot make the {what}")]
    Generate {
        what: &'static str,
        #[source]
        source: rcgen::Error,
    },
    #[error("cannot write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl TlsGenError {
    pub fn category(&self) -> &'static str {
        self.into()
    }
}

/// The files [`write_throwaway`] made.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The CA certificate: clients verify the master with it, the master its clients.
    pub ca: PathBuf,
    /// The master's certificate (names `names`) and key.
    pub master_cert: PathBuf,
    pub master_key: PathBuf,
    /// A client certificate signed by the CA, and its key (for mutual TLS).
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// A throw-away CA kept in memory, whose certificate is written to `<dir>/tls-ca.pem`: it
/// issues a certificate per process (`kvpool up --tls` gives every child its own).
pub struct ThrowawayCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
    /// The CA certificate's file.
    pub ca: PathBuf,
}

/// What a certificate may be used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    /// A TLS server (the master, an agent's transfer target).
    Server,
    /// A TLS client (mutual TLS to the master).
    Client,
    /// Both: a process that serves and dials (an agent: its transfer target and its calls to
    /// the master).
    Both,
}

fn generate(what: &'static str) -> impl Fn(rcgen::Error) -> TlsGenError {
    move |source| TlsGenError::Generate { what, source }
}

fn write(path: &Path, text: &str, private: bool) -> Result<(), TlsGenError> {
    let written = if private {
        write_private(path, text)
    } else {
        std::fs::write(path, text)
    };
    written.map_err(|source| TlsGenError::Write {
        path: path.to_owned(),
        source,
    })
}

impl ThrowawayCa {
    /// Make a CA named `ca_name` and write its certificate into `dir`.
    pub fn create(dir: &Path, ca_name: &str) -> Result<Self, TlsGenError> {
        let ca_key = KeyPair::generate().map_err(generate("CA key"))?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(generate("CA"))?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, ca_name);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(ca_params, ca_key).map_err(generate("CA"))?;
        let ca = dir.join("tls-ca.pem");
        write(&ca, &issuer.pem(), false)?;
        Ok(Self {
            issuer,
            dir: dir.to_owned(),
            ca,
        })
    }

    /// A certificate named `common_name` for `names` (DNS names or IP addresses; none for a
    /// client), written with its key to `<dir>/tls-<stem>.pem` and `tls-<stem>-key.pem`;
    /// returns (certificate, key).
    pub fn issue(
        &self,
        stem: &str,
        common_name: &str,
        names: &[&str],
        usage: Usage,
    ) -> Result<(PathBuf, PathBuf), TlsGenError> {
        let key = KeyPair::generate().map_err(generate("certificate key"))?;
        let sans: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(sans).map_err(generate("certificate"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = match usage {
            Usage::Server => vec![ExtendedKeyUsagePurpose::ServerAuth],
            Usage::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
            Usage::Both => vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        };
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(generate("certificate"))?;
        let paths = (
            self.dir.join(format!("tls-{stem}.pem")),
            self.dir.join(format!("tls-{stem}-key.pem")),
        );
        write(&paths.0, &cert.pem(), false)?;
        write(&paths.1, &key.serialize_pem(), true)?;
        Ok(paths)
    }
}

/// Make a CA named `ca_name`, a master certificate for `names` (DNS names or IP addresses)
/// and a client certificate, all in `dir` (file names `tls-*.pem`).
pub fn write_throwaway(dir: &Path, ca_name: &str, names: &[&str]) -> Result<TlsFiles, TlsGenError> {
    let ca = ThrowawayCa::create(dir, ca_name)?;
    let (master_cert, master_key) = ca.issue("master", "kvpool master", names, Usage::Server)?;
    let (client_cert, client_key) = ca.issue("client", "kvpool client", &[], Usage::Client)?;
    Ok(TlsFiles {
        ca: ca.ca,
        master_cert,
        master_key,
        client_cert,
        client_key,
    })
}

/// Write `text` readable by this user only (0600), whatever the file was before (keys and
/// credentials: `kvpool up` writes its pool key files with it too).
pub fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    // An existing file keeps its mode on open: narrow it before the secret goes in.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    f.write_all(text.as_bytes())
}
