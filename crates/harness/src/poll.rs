//! Polling a condition until it holds or a time limit passes, for the tests that wait on a
//! process or a server to reach a state: a blocking form and one for async tests. I/O boundary:
//! none of its own (it sleeps between checks; the condition does the I/O).

use std::time::{Duration, Instant};

/// Checks `check` every `every` until it returns true (then true) or `limit` has passed since
/// the first check (then false, after one last check past the limit).
pub fn until(limit: Duration, every: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(done) = settled(deadline, &mut check) {
            return done;
        }
        std::thread::sleep(every);
    }
}

/// Like [`until`], sleeping on the tokio timer instead of blocking the thread.
pub async fn until_async(
    limit: Duration,
    every: Duration,
    mut check: impl FnMut() -> bool,
) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(done) = settled(deadline, &mut check) {
            return done;
        }
        tokio::time::sleep(every).await;
    }
}

/// One round of a poll: `Some(true)` once `check` holds, `Some(false)` once `deadline` has
/// passed without it, `None` while there is time to check again.
fn settled(deadline: Instant, check: &mut impl FnMut() -> bool) -> Option<bool> {
    if check() {
        Some(true)
    } else if Instant::now() >= deadline {
        Some(false)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn until_returns_once_the_check_holds_and_gives_up_after_the_limit() {
        let mut n = 0;
        assert!(until(Duration::from_secs(5), Duration::ZERO, || {
            n += 1;
            n == 3
        }));
        assert_eq!(n, 3);
        let started = Instant::now();
        assert!(!until(
            Duration::from_millis(30),
            Duration::from_millis(5),
            || false
        ));
        assert!(started.elapsed() >= Duration::from_millis(30));
    }

    #[tokio::test]
    async fn until_async_polls_on_the_timer() {
        let mut n = 0;
        let done = until_async(Duration::from_secs(5), Duration::from_millis(1), || {
            n += 1;
            n == 2
        })
        .await;
        assert!(done);
        assert!(
            !until_async(Duration::from_millis(10), Duration::from_millis(2), || {
                false
            })
            .await
        );
    }
}
