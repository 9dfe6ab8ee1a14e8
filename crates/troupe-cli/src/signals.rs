//! The stop signals of `troupe serve`, `troupe node` and `troupe demo`: SIGTERM (a
//! service manager), SIGINT (ctrl-c) and SIGHUP (the terminal closed, the ssh session
//! ended) all ask for a graceful stop; a second one during it asks to stop at once.

use std::future::Future;
use std::pin::Pin;

/// A future that completes on a stop signal (or never, if the signal is not watched).
pub type StopSignal = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Two futures: the first completes on the first SIGTERM, SIGINT or SIGHUP, the second
/// on the next one after it. The signals are watched from this call on (their default
/// action, which kills the process, no longer applies): call it before creating anything
/// a signal must not leave behind. If they cannot be watched, `program` says so on
/// stderr, the first completes on ctrl-c alone and the second never does.
pub fn stop_signals(program: &str) -> (StopSignal, StopSignal) {
    use tokio::signal::unix::{signal, SignalKind};
    let watched = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    );
    let (mut terminate, mut interrupt, mut hangup) = match watched {
        (Ok(terminate), Ok(interrupt), Ok(hangup)) => (terminate, interrupt, hangup),
        (Err(error), _, _) | (_, Err(error), _) | (_, _, Err(error)) => {
            crate::errln!(
                "{program}: cannot watch SIGTERM, SIGINT and SIGHUP ({error}); only ctrl-c stops it, and only \
                 gracefully"
            );
            let ctrl_c: StopSignal = Box::pin(async {
                if tokio::signal::ctrl_c().await.is_err() {
                    std::future::pending::<()>().await;
                }
            });
            return (ctrl_c, Box::pin(std::future::pending()));
        }
    };
    let (first_sent, first) = tokio::sync::oneshot::channel::<()>();
    let (second_sent, second) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        for sent in [first_sent, second_sent] {
            tokio::select! {
                biased;
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
                _ = hangup.recv() => {}
            }
            let _ = sent.send(());
        }
    });
    // A sender dropped without sending (the watching task gone) is no signal.
    let wait = |received: tokio::sync::oneshot::Receiver<()>| -> StopSignal {
        Box::pin(async move {
            if received.await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    };
    (wait(first), wait(second))
}
