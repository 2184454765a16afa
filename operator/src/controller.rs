//! What the `KVCachePool` and engine-pool controllers share around their pipelines: the
//! bookkeeping of one pass (duration, outcome and failure metrics by kind; the object's backoff
//! forgotten on success), the retry delay of a failed pass, and the Warning Events they publish
//! on the reconciled object. I/O boundary: the Event recorder inside the [`Context`].

use std::time::Duration;

use kube::Resource;
use kube::runtime::events::{Event, EventType};

use crate::context::Context;
use crate::error::{Error, Result};
use crate::metrics::ReconcileTimer;

/// One pass of the controller of `kind` over one object: timed from [`Pass::start`] until it
/// is dropped, its outcome counted by [`Pass::finish`].
pub struct Pass<'a> {
    ctx: &'a Context,
    kind: &'static str,
    _timer: ReconcileTimer,
}

impl<'a> Pass<'a> {
    /// Start timing a pass.
    pub fn start(ctx: &'a Context, kind: &'static str) -> Self {
        Self {
            ctx,
            kind,
            _timer: ctx.metrics.start(kind),
        }
    }

    /// Count the pass's `result` (the outcome's `label`, or `error` and the failure's
    /// category); on success the backoff of the object `key` is forgotten.
    pub fn finish<O: Copy>(
        &self,
        key: &str,
        result: Result<O>,
        label: fn(O) -> &'static str,
    ) -> Result<O> {
        match result {
            Ok(outcome) => {
                self.ctx.metrics.finished(self.kind, label(outcome));
                self.ctx.reset_backoff(key);
                Ok(outcome)
            }
            Err(err) => {
                self.ctx.metrics.finished(self.kind, "error");
                self.ctx.metrics.failed(self.kind, err.category());
                Err(err)
            }
        }
    }
}

/// How long to wait before retrying `key` after `err`: `None` when retrying cannot help until
/// the object changes (an invalid spec), else the object's next exponential backoff delay.
pub fn retry_delay(ctx: &Context, err: &Error, key: &str) -> Option<Duration> {
    (!err.is_invalid_spec()).then(|| ctx.backoff(key))
}

/// Publish a Warning Event with `reason` on `obj` (the note is cut to 1000 characters, as the
/// API server limits it).
pub async fn publish_warning<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    obj: &K,
    reason: &'static str,
    action: &str,
    message: &str,
) -> Result<()> {
    ctx.recorder
        .publish(
            &Event {
                type_: EventType::Warning,
                reason: reason.to_owned(),
                note: Some(message.chars().take(1000).collect()),
                action: action.to_owned(),
                secondary: None,
            },
            &obj.object_ref(&()),
        )
        .await
        .map_err(|source| Error::PublishEvent { reason, source })
}
