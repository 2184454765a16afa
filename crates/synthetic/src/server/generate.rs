//! One request's run, spawned by the completion endpoint: its prefill half, the report (or the
//! hand-off error) once the prompt's KV is in place, then its decode steps. I/O boundary: the
//! channels back to the endpoint.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::decode::decode;
use super::prefill::{RoomSteps, prefill, prompt_tokens};
use super::report::PrefillReport;
use super::sglang::{HandoffError, effective_role, output_tokens};
use super::shared::Shared;
use kvpool_proto::openai::GenerateRequest;

/// Runs one request: for each of its prompts, KV in (the decode side first waits for its
/// SGLang room), queued prefill compute, KV out; then decode steps, once for all its choices
/// (they share the pieces, as a stand-in for a batch decoded together). The pool reads and writes happen outside the compute lane,
/// as a real engine overlaps KV transfers with other requests' compute; only the modelled
/// compute is serialised. Sends the [`PrefillReport`] (or the hand-off error) on `ready` once the
/// prompt's KV is in place, then each generated piece to `out` (waiting when the client lags:
/// the channel is bounded). Returns `None` when the receiver is gone (the client disconnected).
pub(super) async fn generate(
    shared: Arc<Shared>,
    req: GenerateRequest,
    ready: oneshot::Sender<Result<PrefillReport, HandoffError>>,
    out: mpsc::Sender<String>,
) -> Option<()> {
    let role = effective_role(&shared.config, &req);
    // A batch's prompts are prefilled in turn; the report covers them all.
    let mut report = PrefillReport::default();
    let last = req.prompts.len().saturating_sub(1);
    for (i, prompt) in req.prompts.iter().enumerate() {
        let tokens = prompt_tokens(&shared, prompt);
        let steps = RoomSteps {
            wait: i == 0,
            mark: i == last,
        };
        match prefill(&shared, &req, &tokens, role, steps).await {
            Ok(r) => {
                report.prompt_tokens += r.prompt_tokens;
                report.loaded_blocks += r.loaded_blocks;
                report.load_seconds += r.load_seconds;
            }
            Err(e) => {
                let _ = ready.send(Err(e));
                return None;
            }
        }
    }
    if ready.send(Ok(report)).is_err() {
        return None;
    }
    let max_tokens = output_tokens(&shared.config, role, &req);
    decode(&shared, report.prompt_tokens, max_tokens, &out).await
}
