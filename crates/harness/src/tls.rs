//! Throw-away TLS certificates for the master's port (`kvpool up --tls`, `kvpool bench master
//! --tls`, the TLS tests): a CA, a master certificate for the names given and a client
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

/// Make a CA named `ca_name`, a master certificate for `names` (DNS names or IP addresses)
/// and a client certificate, all in `dir` (file names `tls-*.pem`).
pub fn write_throwaway(dir: &Path, ca_name: &str, names: &[&str]) -> Result<TlsFiles, TlsGenError> {
    let generate = |what| move |source| TlsGenError::Generate { what, source };
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
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key).map_err(generate("CA"))?;

    let leaf = |cn: &str, sans: Vec<String>, usage: ExtendedKeyUsagePurpose| {
        let key = KeyPair::generate().map_err(generate("certificate key"))?;
        let mut params = CertificateParams::new(sans).map_err(generate("certificate"))?;
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        let cert = params
            .signed_by(&key, &ca)
            .map_err(generate("certificate"))?;
        Ok::<_, TlsGenError>((cert.pem(), key.serialize_pem()))
    };
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let (master_cert, master_key) =
        leaf("kvpool master", names, ExtendedKeyUsagePurpose::ServerAuth)?;
    let (client_cert, client_key) =
        leaf("kvpool client", vec![], ExtendedKeyUsagePurpose::ClientAuth)?;

    let files = TlsFiles {
        ca: dir.join("tls-ca.pem"),
        master_cert: dir.join("tls-master.pem"),
        master_key: dir.join("tls-master-key.pem"),
        client_cert: dir.join("tls-client.pem"),
        client_key: dir.join("tls-client-key.pem"),
    };
    let write = |path: &Path, text: &str, private: bool| {
        let written = if private {
            write_private(path, text)
        } else {
            std::fs::write(path, text)
        };
        written.map_err(|source| TlsGenError::Write {
            path: path.to_owned(),
            source,
        })
    };
    write(&files.ca, &ca.pem(), false)?;
    write(&files.master_cert, &master_cert, false)?;
    write(&files.master_key, &master_key, true)?;
    write(&files.client_cert, &client_cert, false)?;
    write(&files.client_key, &client_key, true)?;
    Ok(files)
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
