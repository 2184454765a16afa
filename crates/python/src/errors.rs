//! What a failed call tells Python: kvpool's error kind, the Mooncake error code that kind
//! answers to in `kvpool.mooncake`, and the exception class the native API raises. Every
//! failure of the pool client is sorted here, so the two APIs cannot disagree. Pure, except
//! for building the Python exception.

use pyo3::PyErr;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::types::PyAnyMethods;

use kvpool_client::master::ClientError;
use kvpool_client::pool::DataError;
use kvpool_proto::master::ErrorCode;

create_exception!(
    _native,
    Error,
    PyException,
    "A kvpool call failed; see .kind and .code."
);
create_exception!(_native, NotFound, Error, "No object under that key.");
create_exception!(
    _native,
    Exists,
    Error,
    "The key holds another value; the first stays."
);
create_exception!(
    _native,
    NoSpace,
    Error,
    "The pool has no room for the object."
);
create_exception!(
    _native,
    InvalidArgument,
    Error,
    "An argument is out of range or malformed."
);
create_exception!(
    _native,
    BufferTooSmall,
    InvalidArgument,
    "The buffer is smaller than the object."
);
create_exception!(
    _native,
    NotRegistered,
    InvalidArgument,
    "The memory is not inside a registered buffer."
);
create_exception!(
    _native,
    Leased,
    Error,
    "A reader holds a lease on the object."
);
create_exception!(
    _native,
    Unavailable,
    Error,
    "The master or a holder of the object cannot be reached."
);
create_exception!(
    _native,
    AuthFailed,
    Error,
    "The pool's auth key was refused."
);
create_exception!(
    _native,
    TransferFailed,
    Error,
    "Moving the bytes to or from a replica failed."
);
create_exception!(_native, Closed, Error, "The store was closed.");
create_exception!(
    _native,
    NotSupported,
    Error,
    "kvpool does not offer this call."
);

/// Mooncake's error codes (`mooncake-store/include/types.h`), the ones kvpool answers with.
pub mod code {
    pub const INTERNAL_ERROR: i64 = -1;
    pub const NO_AVAILABLE_HANDLE: i64 = -200;
    pub const INVALID_PARAMS: i64 = -600;
    pub const OBJECT_NOT_FOUND: i64 = -704;
    pub const OBJECT_ALREADY_EXISTS: i64 = -705;
    pub const OBJECT_HAS_LEASE: i64 = -706;
    pub const TRANSFER_FAIL: i64 = -800;
    pub const RPC_FAIL: i64 = -900;
    pub const UNAVAILABLE_IN_CURRENT_MODE: i64 = -1011;
}

/// kvpool's error kinds, as Python sees them (`exc.kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    NotFound,
    /// The key is committed with another value (its first value stays).
    Exists,
    NoSpace,
    InvalidArgument,
    BufferTooSmall,
    NotRegistered,
    Leased,
    Unavailable,
    AuthFailed,
    TransferFailed,
    Closed,
    NotSupported,
    Internal,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::NotFound => "not_found",
            Kind::Exists => "exists",
            Kind::NoSpace => "no_space",
            Kind::InvalidArgument => "invalid_argument",
            Kind::BufferTooSmall => "buffer_too_small",
            Kind::NotRegistered => "not_registered",
            Kind::Leased => "leased",
            Kind::Unavailable => "unavailable",
            Kind::AuthFailed => "auth_failed",
            Kind::TransferFailed => "transfer_failed",
            Kind::Closed => "closed",
            Kind::NotSupported => "not_supported",
            Kind::Internal => "internal",
        }
    }

    /// The Mooncake error code `kvpool.mooncake` returns for this kind: what Mooncake 0.3
    /// answers in the same situation (a buffer too small and a closed store are its
    /// INVALID_PARAMS too).
    pub fn code(self) -> i64 {
        match self {
            Kind::NotFound => code::OBJECT_NOT_FOUND,
            Kind::Exists => code::OBJECT_ALREADY_EXISTS,
            Kind::NoSpace => code::NO_AVAILABLE_HANDLE,
            Kind::InvalidArgument | Kind::NotRegistered | Kind::BufferTooSmall | Kind::Closed => {
                code::INVALID_PARAMS
            }
            Kind::Leased => code::OBJECT_HAS_LEASE,
            Kind::Unavailable | Kind::AuthFailed => code::RPC_FAIL,
            Kind::TransferFailed => code::TRANSFER_FAIL,
            Kind::NotSupported => code::UNAVAILABLE_IN_CURRENT_MODE,
            Kind::Internal => code::INTERNAL_ERROR,
        }
    }
}

/// A failed call: its kind and a message naming what went wrong.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub kind: Kind,
    pub message: String,
}

impl Failure {
    pub fn new(kind: Kind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Kind::InvalidArgument, message)
    }

    pub fn code(&self) -> i64 {
        self.kind.code()
    }
}

/// The message of `e` with its whole source chain.
fn chain(e: &dyn std::error::Error) -> String {
    let causes = std::iter::successors(e.source(), |s| s.source());
    causes.fold(e.to_string(), |out, s| format!("{out}: {s}"))
}

/// The kind of a master client error.
fn master_kind(e: &ClientError) -> Kind {
    match e {
        ClientError::Refused { code, .. } => match code {
            ErrorCode::UnknownKey => Kind::NotFound,
            ErrorCode::NoSpace | ErrorCode::LeaseLimit => Kind::NoSpace,
            ErrorCode::SizeConflict => Kind::Exists,
            ErrorCode::TooLarge | ErrorCode::InvalidArgument => Kind::InvalidArgument,
            ErrorCode::Leased => Kind::Leased,
            ErrorCode::PutInProgress => Kind::InvalidArgument,
            ErrorCode::ReplicasLost => Kind::NotFound,
            ErrorCode::NoSegments => Kind::Unavailable,
            _ => Kind::Internal,
        },
        ClientError::Rpc { source, .. } => match source.code() {
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => Kind::AuthFailed,
            tonic::Code::InvalidArgument => Kind::InvalidArgument,
            tonic::Code::NotFound => Kind::NotFound,
            tonic::Code::ResourceExhausted => Kind::NoSpace,
            _ => Kind::Unavailable,
        },
        ClientError::Batch { source, .. } => master_kind(source),
        ClientError::Connect { .. } => Kind::Unavailable,
        ClientError::NoEndpoints | ClientError::Endpoint { .. } => Kind::InvalidArgument,
        ClientError::Malformed(_) => Kind::Internal,
        // The master's certificate did not verify (or it refused ours): an identity failure.
        ClientError::TlsVerify { .. } => Kind::AuthFailed,
        // The TLS settings themselves (CA, client certificate or key files) are unusable.
        ClientError::TlsSetup(_) => Kind::InvalidArgument,
    }
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Self {
        Failure::new(master_kind(&e), chain(&e))
    }
}

impl From<DataError> for Failure {
    fn from(e: DataError) -> Self {
        let kind = match &e {
            DataError::Master(m) => master_kind(m),
            DataError::StripeIncomplete { .. } | DataError::LeaseExpired { .. } => Kind::NotFound,
            DataError::BufferTooSmall { .. } => Kind::BufferTooSmall,
            DataError::NoEndpoint { .. }
            | DataError::Open { .. }
            | DataError::Transfer { .. }
            | DataError::Local { .. } => Kind::TransferFailed,
            DataError::Staging { .. } => Kind::InvalidArgument,
            _ => Kind::Internal,
        };
        Failure::new(kind, chain(&e))
    }
}

/// The Python exception of a failure: its class follows the kind, and it carries `kind`,
/// `code` (Mooncake's) and the message.
pub fn to_py(f: Failure) -> PyErr {
    let message = f.message.clone();
    let err = match f.kind {
        Kind::NotFound => NotFound::new_err(message),
        Kind::Exists => Exists::new_err(message),
        Kind::NoSpace => NoSpace::new_err(message),
        Kind::InvalidArgument => InvalidArgument::new_err(message),
        Kind::BufferTooSmall => BufferTooSmall::new_err(message),
        Kind::NotRegistered => NotRegistered::new_err(message),
        Kind::Leased => Leased::new_err(message),
        Kind::Unavailable => Unavailable::new_err(message),
        Kind::AuthFailed => AuthFailed::new_err(message),
        Kind::TransferFailed => TransferFailed::new_err(message),
        Kind::Closed => Closed::new_err(message),
        Kind::NotSupported => NotSupported::new_err(message),
        Kind::Internal => Error::new_err(message),
    };
    pyo3::Python::attach(|py| {
        let value = err.value(py);
        // Attributes on a fresh exception object cannot fail in practice; if they did, the
        // exception still carries its class and message.
        let _ = value.setattr("kind", f.kind.as_str());
        let _ = value.setattr("code", f.code());
    });
    err
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> Self {
        to_py(f)
    }
}

/// Adds the exception classes to the module `m`.
pub fn add_to(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
    use pyo3::types::PyModuleMethods;
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("NotFound", py.get_type::<NotFound>())?;
    m.add("Exists", py.get_type::<Exists>())?;
    m.add("NoSpace", py.get_type::<NoSpace>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("BufferTooSmall", py.get_type::<BufferTooSmall>())?;
    m.add("NotRegistered", py.get_type::<NotRegistered>())?;
    m.add("Leased", py.get_type::<Leased>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("AuthFailed", py.get_type::<AuthFailed>())?;
    m.add("TransferFailed", py.get_type::<TransferFailed>())?;
    m.add("Closed", py.get_type::<Closed>())?;
    m.add("NotSupported", py.get_type::<NotSupported>())?;
    Ok(())
}
