//! What the server tests share: a backend's one export, and a server on a Unix
//! socket in a directory of the test's own.

#![allow(dead_code)] // each test binary uses part of it

use lamina_nbd::{Backend, ExportInfo, Listener};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// The one export ("v") of a test backend.
pub fn one_export(description: &str, size: u64) -> Vec<ExportInfo> {
    vec![ExportInfo {
        name: "v".into(),
        description: description.into(),
        size,
    }]
}

/// Serves `backend` on a Unix socket in a fresh directory named after `test`;
/// returns the socket's path and the flag that stops the server.
pub fn serve_unix<B: Backend>(backend: Arc<B>, test: &str) -> (PathBuf, Arc<AtomicBool>) {
    let dir = std::env::temp_dir().join(format!("lamina-nbd-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("s.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || lamina_nbd::serve(backend, Listener::Unix(listener), None, s));
    (sock, stop)
}
