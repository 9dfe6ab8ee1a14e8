//! Store identities for [`troupe_etcd::EtcdConfig::store_identity`]: what binds a
//! cluster name on one etcd to the one store its nodes share.

use std::path::Path;

/// The identity of a SQLite store file shared by the nodes of one machine:
/// `sqlite:<canonical path>`. The same file, named by any path (relative, through a
/// symbolic link), gives the same identity; two files give two. Call it after the store
/// opened the file (it must exist).
///
/// Two deployments on two machines that keep their files at the same path have the
/// same identity and are not told apart: give such a deployment an identity of its own
/// (any stable text, e.g. `sqlite:<host>:<path>`).
///
/// # Errors
/// The operating system's error if the path cannot be resolved (no such file).
pub fn sqlite_store_identity(path: &Path) -> std::io::Result<String> {
    let canonical = std::fs::canonicalize(path)?;
    Ok(format!("sqlite:{}", canonical.display()))
}
