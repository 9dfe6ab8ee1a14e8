//! Placeholder while the SQLite backend is being written (replaced in the same session).

/// The embedded durable store (in progress).
pub struct SqliteStore;
