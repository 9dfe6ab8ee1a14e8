//! The configuration of one node's view of the cluster: where etcd is, which cluster and
//! node this is, and the lease and request times, checked against each other.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::error::ConfigError;

/// Longest cluster or node name, in bytes.
pub const NAME_LENGTH_MAX: usize = 128;
/// The lease TTL a node registers with unless configured otherwise, in seconds.
pub const ETCD_LEASE_TTL_S_DEFAULT: u64 = 5;
/// The shortest lease TTL accepted, in seconds (etcd itself refuses TTLs below about
/// two election timeouts; a shorter one leaves no time to renew).
pub const ETCD_LEASE_TTL_S_MIN: u64 = 3;
/// The longest lease TTL accepted, in seconds: how long a dead node's actors may stay
/// unreachable before another node can place them.
pub const ETCD_LEASE_TTL_S_MAX: u64 = 300;
/// How long one request to etcd may take before it counts as etcd being unavailable,
/// unless configured otherwise, in milliseconds.
pub const ETCD_REQUEST_TIMEOUT_MS_DEFAULT: u64 = 1_000;
/// The shortest request timeout accepted, in milliseconds.
pub const ETCD_REQUEST_TIMEOUT_MS_MIN: u64 = 50;
/// How much earlier than its TTL a server may expire a lease after a renewal, in
/// milliseconds: madsim's simulated etcd counts TTLs down in whole-second ticks, so a
/// lease can end up to one second early. A node stops trusting its lease this long
/// before the TTL since its last confirmed renewal is up.
pub const ETCD_LEASE_EXPIRY_SLACK_MS: u64 = 1_000;
/// Pause before a request to etcd that met etcd unavailable (a dead endpoint, a broken
/// connection) is sent again, in milliseconds; it is sent again until the request
/// timeout has passed since the first attempt. A lease renewal that failed is likewise
/// tried again on a new stream within its request timeout.
pub const ETCD_RETRY_PAUSE_MS: u64 = 10;
/// Keep-alives per lease TTL: a node renews its lease every `TTL / 3`, or sooner (see
/// [`ETCD_RENEWAL_HEADROOM_MS`]).
pub const ETCD_KEEP_ALIVES_PER_TTL: u32 = 3;
/// Validity beyond one request timeout that a renewal leaves when it is sent, in
/// milliseconds: a node renews every `min(TTL / 3, TTL − slack − request timeout −
/// this)` after the last renewal was sent, so a renewal answered within this never
/// leaves a placement waiting for it (with the largest request timeout a 3 s lease
/// accepts, 999 ms, `TTL / 3` left exactly one request and every renewal's round trip
/// made placements wait).
pub const ETCD_RENEWAL_HEADROOM_MS: u64 = 100;
/// Longest store identity ([`EtcdConfig::store_identity`]), in bytes.
pub const STORE_IDENTITY_LENGTH_MAX: usize = 1_024;

/// The name of one node in a cluster, as it appears in etcd keys: 1 to
/// [`NAME_LENGTH_MAX`] bytes of ASCII letters, digits, `-`, `_` and `.`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(Arc<str>);

impl NodeId {
    /// Validates and builds a node name.
    ///
    /// # Errors
    /// [`ConfigError::BadName`] naming what was wrong.
    pub fn new(name: impl AsRef<str>) -> Result<Self, ConfigError> {
        check_name("node", name.as_ref())?;
        Ok(Self(Arc::from(name.as_ref())))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeId({})", self.0)
    }
}

/// Checks a cluster or node name: the characters allowed keep etcd keys unambiguous
/// (no `/`) and printable.
pub(crate) fn check_name(what: &'static str, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > NAME_LENGTH_MAX {
        return Err(ConfigError::BadName {
            what,
            name: name.to_string(),
            reason: format!("must be 1 to {NAME_LENGTH_MAX} bytes long, is {}", name.len()),
        });
    }
    if let Some(character) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(ConfigError::BadName {
            what,
            name: name.to_string(),
            reason: format!("holds {character:?}; use ASCII letters, digits, '-', '_' or '.'"),
        });
    }
    Ok(())
}

/// Where etcd is and how this node uses it; build with [`EtcdConfig::new`] and the
/// `with_*` methods, checked by [`EtcdConfig::validate`] when a placement starts.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// etcd client endpoints as `host:port` (no scheme, so the same text works for the
    /// real client and the simulator).
    pub endpoints: Vec<String>,
    /// The cluster's name: every key lives under `/troupe/<cluster>/`.
    pub cluster: String,
    /// This node's name.
    pub node: NodeId,
    /// What other nodes dial to reach this node, stored in its membership record.
    pub address: String,
    /// The node's lease TTL, in whole seconds (etcd's unit).
    pub lease_ttl_s: u64,
    /// How long one request to etcd may take, in milliseconds.
    pub request_timeout_ms: u64,
    /// The identity of the store this node's actors are kept in (e.g.
    /// `PostgresStore::identity`, or `troupe_cluster::sqlite_store_identity`), or
    /// `None` to check nothing. The first node that joins with one records it under
    /// `/troupe/<cluster>/store`; a node whose store has another identity is refused
    /// ([`crate::PlacementError::StoreMismatch`]): two deployments that share a cluster
    /// name on one etcd would mix their placements, and calls would reach nodes that
    /// keep other state.
    pub store_identity: Option<String>,
}

impl EtcdConfig {
    /// A configuration with the default lease TTL and request timeout.
    pub fn new(endpoints: Vec<String>, cluster: impl Into<String>, node: NodeId, address: impl Into<String>) -> Self {
        Self {
            endpoints,
            cluster: cluster.into(),
            node,
            address: address.into(),
            lease_ttl_s: ETCD_LEASE_TTL_S_DEFAULT,
            request_timeout_ms: ETCD_REQUEST_TIMEOUT_MS_DEFAULT,
            store_identity: None,
        }
    }

    /// Sets the identity of the store the node uses ([`EtcdConfig::store_identity`]).
    #[must_use]
    pub fn with_store_identity(mut self, identity: impl Into<String>) -> Self {
        self.store_identity = Some(identity.into());
        self
    }

    /// Sets the lease TTL, in seconds.
    #[must_use]
    pub fn with_lease_ttl_s(mut self, lease_ttl_s: u64) -> Self {
        self.lease_ttl_s = lease_ttl_s;
        self
    }

    /// Sets the request timeout, in milliseconds.
    #[must_use]
    pub fn with_request_timeout_ms(mut self, request_timeout_ms: u64) -> Self {
        self.request_timeout_ms = request_timeout_ms;
        self
    }

    /// Checks every field and the relation between the times: after a renewal, a node
    /// trusts its lease for `TTL − ETCD_LEASE_EXPIRY_SLACK_MS`, and places an actor only
    /// if a request can finish inside that; the next renewal comes at most `TTL / 3`
    /// later, so `TTL − slack − request timeout` must exceed `TTL / 3`, else a healthy node's
    /// placements would wait for a renewal between every two renewals.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field and the violated bound.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.endpoints.is_empty() {
            return Err(ConfigError::NoEndpoints);
        }
        check_name("cluster", &self.cluster)?;
        if let Some(identity) = &self.store_identity {
            if identity.is_empty() || identity.len() > STORE_IDENTITY_LENGTH_MAX {
                return Err(ConfigError::BadStoreIdentity {
                    identity: identity.clone(),
                    reason: format!(
                        "must be 1 to {STORE_IDENTITY_LENGTH_MAX} bytes long, is {}",
                        identity.len()
                    ),
                });
            }
        }
        if !(ETCD_LEASE_TTL_S_MIN..=ETCD_LEASE_TTL_S_MAX).contains(&self.lease_ttl_s) {
            return Err(ConfigError::OutOfRange {
                field: "lease_ttl_s",
                value: self.lease_ttl_s,
                min: ETCD_LEASE_TTL_S_MIN,
                max: ETCD_LEASE_TTL_S_MAX,
            });
        }
        let ttl_ms = self.lease_ttl_s * 1_000;
        let request_max = ttl_ms - ETCD_LEASE_EXPIRY_SLACK_MS - ttl_ms / u64::from(ETCD_KEEP_ALIVES_PER_TTL) - 1;
        if !(ETCD_REQUEST_TIMEOUT_MS_MIN..=request_max).contains(&self.request_timeout_ms) {
            return Err(ConfigError::OutOfRange {
                field: "request_timeout_ms",
                value: self.request_timeout_ms,
                min: ETCD_REQUEST_TIMEOUT_MS_MIN,
                max: request_max,
            });
        }
        Ok(())
    }

    pub(crate) fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// How long after one renewal was sent the next is sent: `TTL / 3`, or sooner so
    /// that one request and [`ETCD_RENEWAL_HEADROOM_MS`] of validity are left then.
    pub(crate) fn keep_alive_interval(&self) -> Duration {
        let every_third = Duration::from_secs(self.lease_ttl_s) / ETCD_KEEP_ALIVES_PER_TTL;
        let headroom = Duration::from_secs(self.lease_ttl_s)
            .saturating_sub(Duration::from_millis(ETCD_LEASE_EXPIRY_SLACK_MS))
            .saturating_sub(self.request_timeout())
            .saturating_sub(Duration::from_millis(ETCD_RENEWAL_HEADROOM_MS));
        every_third.min(headroom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(lease_ttl_s: u64, request_timeout_ms: u64) -> EtcdConfig {
        EtcdConfig::new(
            vec!["127.0.0.1:2379".to_string()],
            "c",
            NodeId::new("n").expect("a node name"),
            "127.0.0.1:7100",
        )
        .with_lease_ttl_s(lease_ttl_s)
        .with_request_timeout_ms(request_timeout_ms)
    }

    /// Goal: every valid configuration renews while one request and
    /// `ETCD_RENEWAL_HEADROOM_MS` of validity are left, and no more often than needed:
    /// TTL/3 where that leaves enough (the default 5 s and 1 s; 3 s and 500 ms), sooner
    /// where it does not (3 s and 999 ms: 901 ms, not 1 s, which left exactly one
    /// request). Method: the interval of named configurations, and the bound for every
    /// TTL up to 30 s with request timeouts across their valid range.
    #[test]
    fn renewals_leave_one_request_and_the_headroom_of_validity() {
        assert_eq!(config(3, 999).keep_alive_interval(), Duration::from_millis(901));
        assert_eq!(config(3, 500).keep_alive_interval(), Duration::from_secs(1));
        assert_eq!(config(5, 1_000).keep_alive_interval(), Duration::from_secs(5) / 3);
        for ttl_s in ETCD_LEASE_TTL_S_MIN..=30 {
            for request_ms in (ETCD_REQUEST_TIMEOUT_MS_MIN..ttl_s * 1_000).step_by(37) {
                let config = config(ttl_s, request_ms);
                if config.validate().is_err() {
                    continue;
                }
                let interval = config.keep_alive_interval();
                let validity = Duration::from_secs(ttl_s) - Duration::from_millis(ETCD_LEASE_EXPIRY_SLACK_MS);
                assert!(
                    validity - interval >= Duration::from_millis(request_ms + ETCD_RENEWAL_HEADROOM_MS),
                    "{ttl_s} s, {request_ms} ms: renews every {interval:?}"
                );
                assert!(interval <= Duration::from_secs(ttl_s) / ETCD_KEEP_ALIVES_PER_TTL);
                assert!(
                    interval >= Duration::from_millis(800),
                    "{ttl_s} s, {request_ms} ms: {interval:?}"
                );
            }
        }
    }
}
