//! The issuer's TLS identity. The CA's Ed25519 key is `HMAC-SHA256(root key,
//! "kvpool-agent-issuer-ca-v1")` used as the key's seed, and its certificate has fixed
//! validity dates and serial, so the CA certificate is byte-for-byte the same on every replica
//! and every start (Ed25519 signatures are deterministic): the pool documents that carry it do
//! not change, and no agent restarts, when the operator does. The server certificate under it
//! gets a fresh key at each start. I/O boundary: none.

use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, PKCS_ED25519, SerialNumber,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::root_key::RootKey;

/// Label of the CA key's derivation from the root key.
pub const CA_KEY_LABEL: &str = "kvpool-agent-issuer-ca-v1";
/// Common name of the issuer's CA.
const CA_NAME: &str = "kvpool agent credential issuer CA";
/// PKCS#8 v1 header of an Ed25519 private key (RFC 8410); the 32-byte seed follows.
const ED25519_PKCS8_PREFIX: [u8; 16] = [
    0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20,
];

/// Why the issuer's certificates could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("making the agent credential issuer's {what}")]
    Generate {
        what: &'static str,
        #[source]
        source: rcgen::Error,
    },
    #[error("the agent credential issuer's TLS server configuration")]
    Config(#[source] rustls::Error),
}

fn err(what: &'static str) -> impl Fn(rcgen::Error) -> CaError {
    move |source| CaError::Generate { what, source }
}

/// The issuer's CA, derived from the root key.
pub struct IssuerCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl std::fmt::Debug for IssuerCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IssuerCa(..)")
    }
}

impl IssuerCa {
    /// The CA of the operator whose root key is `root`.
    pub fn derive(root: &RootKey) -> Result<Self, CaError> {
        let seed = root.derive_secret(CA_KEY_LABEL);
        let mut pkcs8 = ED25519_PKCS8_PREFIX.to_vec();
        pkcs8.extend_from_slice(&seed);
        let der = PrivatePkcs8KeyDer::from(pkcs8);
        let key =
            KeyPair::from_pkcs8_der_and_sign_algo(&der, &PKCS_ED25519).map_err(err("CA key"))?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err("CA"))?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.distinguished_name.push(DnType::CommonName, CA_NAME);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        // Fixed, so the certificate is the same at every start (a CA certificate used as a
        // trust anchor is not checked for validity; the server certificates are).
        params.not_before = rcgen::date_time_ymd(2025, 1, 1);
        params.not_after = rcgen::date_time_ymd(2125, 1, 1);
        params.serial_number = Some(SerialNumber::from(vec![1]));
        let issuer = CertifiedIssuer::self_signed(params, key).map_err(err("CA certificate"))?;
        Ok(Self { issuer })
    }

    /// The CA certificate, PEM: what agents trust.
    pub fn ca_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A TLS server configuration for `names` (the DNS names agents dial), with a fresh key
    /// (rcgen's default validity: the certificate lives as long as this process).
    pub fn server_config(&self, names: &[String]) -> Result<Arc<rustls::ServerConfig>, CaError> {
        let key = KeyPair::generate_for(&PKCS_ED25519).map_err(err("server key"))?;
        let mut params = CertificateParams::new(names.to_vec()).map_err(err("server"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, "kvpool agent credential issuer");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(err("server certificate"))?;
        let chain = vec![CertificateDer::from(cert.der().to_vec())];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key))
            .map_err(CaError::Config)?;
        Ok(Arc::new(config))
    }
}
