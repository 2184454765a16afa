//! The prefill engines' KV events in the conductor: what each engine holds according to its
//! own event stream (`holdings`, pure), fed by the subscriber in `server::kv_feed` (the ZMQ
//! sockets). An engine with an event stream is indexed from its events only; the mirror of
//! routing decisions (`State`'s cache mirror) is the fallback for engines without one.

pub mod holdings;

pub use holdings::{Applied, Delta, Holdings, Step, step};
