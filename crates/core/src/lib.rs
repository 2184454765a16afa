//! kvpool's pure core: the master's metadata state machine (`master`), the KVCache-centric
//! scheduling policies and block keys (`sched`), exact quantiles of small samples
//! (`quantile`), the SLO-driven autoscaling decision (`autoscale`), the trace simulator that replays Mooncake traces through them (`sim`), and
//! the range checks of command-line values (`flags`). No async runtime, no RPC, no Kubernetes:
//! time is passed in (an injected clock), and the only I/O is reading trace files in
//! `sim::trace` and `master::simulate`. Everything that serves, calls or stores builds on
//! these types.

pub mod autoscale;
pub mod flags;
pub mod master;
pub mod quantile;
pub mod sched;
pub mod sim;
