//! The decode half of one request: it joins the decode batch and generates its tokens one step
//! at a time, each step as long as the decode cost model says for the batch's current size and
//! context. I/O boundary: the step timers and the channel to the response.

use std::sync::atomic::Ordering;

use tokio::sync::mpsc;

use super::shared::Shared;

/// Membership in the decode batch; leaves it when dropped (also when the client goes away).
struct DecodeSeat<'a> {
    shared: &'a Shared,
    tokens: u64,
}

impl<'a> DecodeSeat<'a> {
    fn join(shared: &'a Shared, tokens: u64) -> Self {
        shared.decoding.fetch_add(1, Ordering::SeqCst);
        shared.decode_tokens.fetch_add(tokens, Ordering::SeqCst);
        Self { shared, tokens }
    }
    fn grow(&mut self) {
        self.tokens += 1;
        self.shared.decode_tokens.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for DecodeSeat<'_> {
    fn drop(&mut self) {
        self.shared.decoding.fetch_sub(1, Ordering::SeqCst);
        self.shared
            .decode_tokens
            .fetch_sub(self.tokens, Ordering::SeqCst);
    }
}

/// Generates `max_tokens` pieces for a prompt of `prompt_tokens`, sending each to `out`
/// (waiting when the client lags: the channel is bounded). Returns `None` when the receiver is
/// gone (the client disconnected).
pub(super) async fn decode(
    shared: &Shared,
    prompt_tokens: u64,
    max_tokens: u32,
    out: &mpsc::Sender<String>,
) -> Option<()> {
    let mut seat = DecodeSeat::join(shared, prompt_tokens);
    for i in 0..max_tokens {
        let batch = shared.decoding.load(Ordering::SeqCst);
        let ctx = shared.decode_tokens.load(Ordering::SeqCst);
        let step = shared.config.decode_cost.step_seconds(batch, ctx);
        shared.work(step).await;
        seat.grow();
        shared.metrics.generated_tokens.inc();
        if out.send(format!("tok{i} ")).await.is_err() {
            return None;
        }
    }
    Some(())
}
