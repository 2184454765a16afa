//! What a failed call tells Python: kvpool's error kind, the Mooncake error code that kind
//! answers to in `kvpool.mooncake`, and the exception class the native API raises. Every
//! failure of the pool client is sorted here, so the two APIs cannot disagree. Pure, except
//! for building the Python exception.
//!
//! The classes are created here but named `kvpool.X`, the public name the package exports them
//! under, so that pickle (which imports a class by its `__module__` and `__qualname__`) and
//! tracebacks find them; an instance pickles as its class, its message and its `kind` and
//! `code`, which every class also carries as class attributes.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::types::{PyAnyMethods, PyModule, PyModuleMethods, PyType, PyTypeMethods};
use pyo3::{Bound, PyErr, PyResult, Python};

use kvpool_client::master::ClientError;
use kvpool_client::pool::DataError;
use kvpool_proto::master::ErrorCode;

create_exception!(
    kvpool,
    Error,
    PyException,
    "A kvpool call failed; see .kind and .code."
);
create_exception!(kvpool, NotFound, Error, "No object under that key.");
create_exception!(
    kvpool,
    Exists,
    Error,
    "The key holds another value; the first stays."
);
create_exception!(
    kvpool,
    NoSpace,
    Error,
    "The pool has no room for the object."
);
create_exception!(
    kvpool,
    InvalidArgument,
    Error,
    "An argument is out of range or malformed."
);
create_exception!(
    kvpool,
    BufferTooSmall,
    InvalidArgument,
    "The buffer is smaller than the object."
);
create_exception!(
    kvpool,
    NotRegistered,
    InvalidArgument,
    "The memory is not inside a registered buffer."
);
create_exception!(
    kvpool,
    Leased,
    Error,
    "A reader holds a lease on the object."
);
create_exception!(
    kvpool,
    Unavailable,
    Error,
    "The master or a holder of the object cannot be reached."
);
create_exception!(
    kvpool,
    AuthFailed,
    Error,
    "The pool's auth key was refused."
);
create_exception!(
    kvpool,
    TransferFailed,
    Error,
    "Moving the bytes to or from a replica failed."
);
create_exception!(kvpool, Closed, Error, "The store was closed.");
create_exception!(
    kvpool,
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
    /// Every kind, one per exception class.
    pub const ALL: [Kind; 13] = [
        Kind::NotFound,
        Kind::Exists,
        Kind::NoSpace,
        Kind::InvalidArgument,
        Kind::BufferTooSmall,
        Kind::NotRegistered,
        Kind::Leased,
        Kind::Unavailable,
        Kind::AuthFailed,
        Kind::TransferFailed,
        Kind::Closed,
        Kind::NotSupported,
        Kind::Internal,
    ];

    /// The exception class a failure of this kind raises (`Error` itself for `Internal`).
    pub fn exception_type(self, py: Python<'_>) -> Bound<'_, PyType> {
        match self {
            Kind::NotFound => py.get_type::<NotFound>(),
            Kind::Exists => py.get_type::<Exists>(),
            Kind::NoSpace => py.get_type::<NoSpace>(),
            Kind::InvalidArgument => py.get_type::<InvalidArgument>(),
            Kind::BufferTooSmall => py.get_type::<BufferTooSmall>(),
            Kind::NotRegistered => py.get_type::<NotRegistered>(),
            Kind::Leased => py.get_type::<Leased>(),
            Kind::Unavailable => py.get_type::<Unavailable>(),
            Kind::AuthFailed => py.get_type::<AuthFailed>(),
            Kind::TransferFailed => py.get_type::<TransferFailed>(),
            Kind::Closed => py.get_type::<Closed>(),
            Kind::NotSupported => py.get_type::<NotSupported>(),
            Kind::Internal => py.get_type::<Error>(),
        }
    }

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
/// `code` (Mooncake's) and the message (its only argument, so that it pickles).
pub fn to_py(f: Failure) -> PyErr {
    Python::attach(|py| {
        let err = PyErr::from_type(f.kind.exception_type(py), f.message);
        let value = err.value(py);
        // Attributes on a fresh exception object cannot fail in practice; if they did, the
        // exception still carries its class, its message and the class's kind and code.
        let _ = value.setattr("kind", f.kind.as_str());
        let _ = value.setattr("code", f.kind.code());
        err
    })
}

impl From<Failure> for PyErr {
    fn from(f: Failure) -> Self {
        to_py(f)
    }
}

/// Adds the exception classes to the module `m`, each with its kind's `kind` and `code` as
/// class attributes (what an instance made in Python, not raised by kvpool, answers).
pub fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    for kind in Kind::ALL {
        let class = kind.exception_type(py);
        class.setattr("kind", kind.as_str())?;
        class.setattr("code", kind.code())?;
        m.add(class.name()?, class)?;
    }
    Ok(())
}
