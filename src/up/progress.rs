//! The replay's progress line on stderr: requests finished out of the trace's, with the
//! served / rejected / failed counts so far. Drawn only when stderr is a terminal and the output
//! is not `--json` (a log file, a pipe or `kubectl logs` get nothing from it: the summary at the
//! end says it all). I/O boundary: stderr, through indicatif.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::replay::Outcome;

/// Whether a replay draws its progress: a person is watching stderr and asked for text.
pub fn visible(json: bool, stderr_is_terminal: bool) -> bool {
    !json && stderr_is_terminal
}

/// Counts of the requests finished so far, and the bar that shows them.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    served: AtomicUsize,
    rejected: AtomicUsize,
    failed: AtomicUsize,
}

impl Progress {
    /// Progress over `total` requests, drawn on stderr when [`visible`] says so.
    pub fn new(total: usize, json: bool) -> Self {
        let target = if visible(json, std::io::stderr().is_terminal()) {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total as u64), target);
        if let Ok(style) =
            ProgressStyle::with_template("replay {pos}/{len} requests ({msg}) {elapsed} {wide_bar}")
        {
            bar.set_style(style);
        }
        let p = Self {
            bar,
            served: AtomicUsize::new(0),
            rejected: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
        };
        p.bar.set_message(p.message());
        p
    }

    /// One more request finished with `outcome`.
    pub fn record(&self, outcome: &Outcome) {
        let counter = match outcome {
            Outcome::Served { .. } => &self.served,
            Outcome::Rejected => &self.rejected,
            Outcome::Failed => &self.failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.bar.set_message(self.message());
        self.bar.inc(1);
    }

    /// Requests finished so far.
    pub fn finished(&self) -> u64 {
        self.bar.position()
    }

    /// The counts as the bar shows them.
    pub fn message(&self) -> String {
        format!(
            "{} served, {} rejected, {} failed",
            self.served.load(Ordering::Relaxed),
            self.rejected.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed)
        )
    }

    /// Takes the bar off the screen (the summary follows).
    pub fn clear(&self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_only_for_a_person_reading_text() {
        assert!(visible(false, true));
        assert!(!visible(true, true), "never with --json");
        assert!(!visible(false, false), "never into a file or a pipe");
        assert!(!visible(true, false));
    }

    #[test]
    fn counts_every_outcome_once() {
        // Under the test harness stderr is not a terminal: the bar is hidden but counts.
        let p = Progress::new(4, false);
        p.record(&Outcome::Served {
            ttft_s: 0.1,
            tpot_s: None,
            tokens: 3,
            predicted_ttft_s: None,
        });
        p.record(&Outcome::Rejected);
        p.record(&Outcome::Failed);
        p.record(&Outcome::Failed);
        assert_eq!(p.finished(), 4);
        assert_eq!(p.message(), "1 served, 1 rejected, 2 failed");
        p.clear();
    }
}
