//! The simulated etcd the cluster simulations run against (madsim-etcd-client's server).

use std::net::SocketAddr;
use std::time::Duration;

use madsim::runtime::{Handle, NodeHandle};

/// How long a new simulated etcd is given to start serving, in milliseconds.
const SIM_ETCD_START_MS: u64 = 100;

/// Starts the simulated etcd on a node of its own (named `etcd`) at `address`, and waits
/// until it serves.
pub(crate) async fn start_sim_etcd(handle: &Handle, address: &str) -> NodeHandle {
    let etcd_address: SocketAddr = address.parse().expect("an address");
    let etcd = handle
        .create_node()
        .name("etcd")
        .ip(etcd_address.ip())
        .init(move || async move {
            etcd_client::SimServer::builder()
                .serve(etcd_address)
                .await
                .expect("the simulated etcd serves");
        })
        .build();
    tokio::time::sleep(Duration::from_millis(SIM_ETCD_START_MS)).await;
    etcd
}
