//! Store identities for [`troupe_etcd::EtcdConfig::store_identity`]: what binds a
//! cluster name on one etcd to the one store its nodes share.

use std::path::Path;

/// The identity of a SQLite store file shared by the nodes of one machine: the identity
/// stored in the file itself (`SqliteStore::identity`, read with
/// [`troupe_runtime::sqlite_file_identity`]). The same file, named by any path
/// (relative, through a symbolic link), gives the same identity, and keeps it when it
/// is moved or renamed; two files give two, two files created one after another at one
/// path (the first deleted) too, as do two machines' files at one path.
///
/// A file created by this build has `sqlite:<microseconds at its creation>:<its
/// canonical path then>`; a file created before identities were stored in files gets,
/// at its first open by this build, `sqlite:<its canonical path>`, the identity this
/// function gave before (computed from the path), so that a cluster name already bound
/// to it stays bound. Two such older files on two machines at one path still share an
/// identity: give such a deployment an identity of its own (any stable text).
///
/// Call it after the store opened the file (it must exist).
///
/// # Errors
/// The operating system's error if the path cannot be resolved (no such file); an
/// error of kind `Other` with the store's error if the file cannot be opened as a
/// store, or if the build has no SQLite (`troupe-runtime`'s `sqlite` feature, which a
/// program that opens a `SqliteStore` has on).
pub fn sqlite_store_identity(path: &Path) -> std::io::Result<String> {
    // Resolved first: the store would create a file that does not exist.
    let canonical = std::fs::canonicalize(path)?;
    troupe_runtime::sqlite_file_identity(&canonical).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use troupe_runtime::SqliteStore;

    use super::*;

    /// Goal: a SQLite file's cluster identity is the one stored in the file: it survives
    /// a rename into another directory, and a new file created at the old path has
    /// another. Before, it was `sqlite:<canonical path>`: the moved file's identity
    /// changed (its nodes were refused their own cluster), and the new file at the old
    /// path took the old one's.
    #[test]
    fn a_sqlite_files_identity_moves_with_it_and_a_new_file_at_its_path_has_another() {
        let directory = tempfile::tempdir().expect("a directory");
        let path = directory.path().join("state.sqlite");
        drop(SqliteStore::open(&path).expect("create the store"));
        let identity = sqlite_store_identity(&path).expect("the identity");
        assert!(identity.ends_with("state.sqlite"), "names the file: {identity}");

        std::fs::create_dir(directory.path().join("moved")).expect("another directory");
        let moved = directory.path().join("moved").join("renamed.sqlite");
        std::fs::rename(&path, &moved).expect("move the file");
        assert_eq!(
            sqlite_store_identity(&moved).expect("the moved file's identity"),
            identity
        );

        drop(SqliteStore::open(&path).expect("a new store at the old path"));
        assert_ne!(sqlite_store_identity(&path).expect("the new file's identity"), identity);
        assert!(
            sqlite_store_identity(&directory.path().join("none.sqlite")).is_err(),
            "no such file"
        );
    }
}
