//! The NBD protocol, and nothing else: handshake, requests, replies. Storage lives
//! behind the [`server::Backend`] trait.

pub mod client;
pub mod proto;
mod ring;
pub mod server;
pub mod stats;
pub mod tls;

pub use server::{
    serve, serve_connection, Backend, Command, Completion, Conn, DeviceRead, ExportInfo, Extent,
    Finished, HeaderRead, Listener, ReadPool, ReadStart, MAX_EXTENTS,
};
pub use tls::TlsPolicy;
