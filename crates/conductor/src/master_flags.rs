//! What `kvpool conductor --master` asks of the master besides the per-request pool lookups:
//! sharing this replica's bookings with the other replicas (`--share-load-period`) and more
//! copies of a hot prefix's blocks in the pool (`--hot-pool-replicas`, `--hot-pool-ttl`).
//! Pure: flags in, settings out.

use std::time::Duration;

use kvpool_core::flags::FlagError;

use crate::config::{HotPool, ShareLoad};

/// The flags.
#[derive(Debug, Clone, clap::Args)]
pub struct MasterShareArgs {
    /// With --master: how often this replica shares its bookings with the other conductor
    /// replicas through the master (docs/adr/0010-conductor-replicas-share-bookings.md); `0s`:
    /// book alone.
    #[arg(long, default_value = "25ms", value_parser = kvpool_core::flags::parse_duration,
        env = "KVPOOL_SHARE_LOAD_PERIOD")]
    pub share_load_period: Duration,
    /// With --master: copies of a hot prefix's blocks the pool keeps while it is hot (the
    /// master makes them on other agents and frees them after --hot-pool-ttl), so that more
    /// engines read it from a nearby copy (docs/scheduling.md "Hot blocks"); default one per
    /// engine it is copied to (--hot-fanout) plus the original, at most 8; `1`: none.
    #[arg(long, env = "KVPOOL_HOT_POOL_REPLICAS")]
    pub hot_pool_replicas: Option<u8>,
    /// With --master: how long a hot prefix keeps its extra copies after its last hot hit.
    #[arg(long, default_value = "10m", value_parser = kvpool_core::flags::parse_duration,
        env = "KVPOOL_HOT_POOL_TTL")]
    pub hot_pool_ttl: Duration,
}

/// The sharing and hot-copy settings of the flags, for a conductor that copies hot prefixes
/// to `hot_fanout` more engines.
pub fn settings(
    args: &MasterShareArgs,
    hot_fanout: usize,
) -> Result<(Option<ShareLoad>, Option<HotPool>), FlagError> {
    let share =
        (!args.share_load_period.is_zero()).then(|| ShareLoad::every(args.share_load_period));
    let replicas = match args.hot_pool_replicas {
        Some(0) | Some(9..) => {
            return Err(FlagError::new("hot-pool-replicas", "must be from 1 to 8"));
        }
        Some(n) => n,
        None => u8::try_from(hot_fanout.saturating_add(1))
            .unwrap_or(u8::MAX)
            .min(8),
    };
    if args.hot_pool_ttl.is_zero() || args.hot_pool_ttl > Duration::from_secs(3600) {
        return Err(FlagError::new(
            "hot-pool-ttl",
            "must be more than 0s and at most 1h",
        ));
    }
    let hot = (replicas > 1).then_some(HotPool {
        replicas,
        ttl: args.hot_pool_ttl,
    });
    Ok((share, hot))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(replicas: Option<u8>, ttl: u64, period_ms: u64) -> MasterShareArgs {
        MasterShareArgs {
            share_load_period: Duration::from_millis(period_ms),
            hot_pool_replicas: replicas,
            hot_pool_ttl: Duration::from_secs(ttl),
        }
    }

    #[test]
    fn defaults_follow_the_fanout_and_zero_turns_sharing_off() {
        let (share, hot) = settings(&args(None, 600, 25), 2).unwrap();
        assert_eq!(share, Some(ShareLoad::every(Duration::from_millis(25))));
        assert_eq!(hot.map(|h| h.replicas), Some(3));
        assert_eq!(
            settings(&args(None, 600, 25), 20)
                .unwrap()
                .1
                .map(|h| h.replicas),
            Some(8)
        );
        let (share, hot) = settings(&args(Some(1), 600, 0), 2).unwrap();
        assert_eq!((share, hot), (None, None));
    }

    #[test]
    fn out_of_range_values_name_their_flag() {
        for (a, flag) in [
            (args(Some(0), 600, 25), "hot-pool-replicas"),
            (args(Some(9), 600, 25), "hot-pool-replicas"),
            (args(None, 0, 25), "hot-pool-ttl"),
            (args(None, 3601, 25), "hot-pool-ttl"),
        ] {
            let e = settings(&a, 2).unwrap_err();
            assert!(e.to_string().contains(flag), "{e}");
        }
    }
}
