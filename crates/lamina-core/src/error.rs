//! Errors of the engine, one line of documentation each, and the NBD error number each
//! maps to.

use lamina_device::DeviceError;
use lamina_format::FormatError;

#[derive(Debug, thiserror::Error, Clone)]
pub enum EngineError {
    /// The array has no room for more live data (thin provisioning exhausted).
    #[error("no space left on the array: {0}")]
    NoSpace(String),
    /// A request that cannot be valid: past the end of a volume, unknown volume, ...
    #[error("invalid request: {0}")]
    Invalid(String),
    /// A device failed a read or write.
    #[error("device I/O error: {0}")]
    Io(String),
    /// Data failed its checksum and no good copy exists.
    #[error("corrupt data: {0}")]
    Corrupt(String),
    /// The array stopped accepting writes after a device failure.
    #[error("array is read-only after a failure: {0}")]
    Failed(String),
    /// On-disk metadata could not be decoded.
    #[error("damaged metadata: {0}")]
    Format(String),
    /// The array is shutting down.
    #[error("shutting down")]
    ShuttingDown,
    /// A write to a volume that takes none (a snapshot).
    #[error("read-only: {0}")]
    ReadOnly(String),
}

impl EngineError {
    /// The NBD (and POSIX) error number for replies.
    pub fn errno(&self) -> u32 {
        const EPERM: u32 = 1;
        const EIO: u32 = 5;
        const EINVAL: u32 = 22;
        const ENOSPC: u32 = 28;
        const ESHUTDOWN: u32 = 108;
        match self {
            EngineError::NoSpace(_) => ENOSPC,
            EngineError::Invalid(_) => EINVAL,
            EngineError::ShuttingDown => ESHUTDOWN,
            EngineError::ReadOnly(_) => EPERM,
            EngineError::Io(_)
            | EngineError::Corrupt(_)
            | EngineError::Failed(_)
            | EngineError::Format(_) => EIO,
        }
    }
}

impl From<DeviceError> for EngineError {
    fn from(e: DeviceError) -> Self {
        EngineError::Io(e.to_string())
    }
}

impl From<FormatError> for EngineError {
    fn from(e: FormatError) -> Self {
        EngineError::Format(e.to_string())
    }
}
