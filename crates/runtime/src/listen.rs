//! The listen flags every HTTP service started from the CLI has, `--listen` (its API) and
//! `--admin-listen` (`/livez`, `/readyz`, `/metrics`), with the connection limits of both
//! servers (`--http-header-read-timeout` and the like, see [`HttpLimitArgs`]), as one clap
//! `Args` struct that `kvpool engine` and `kvpool conductor` flatten into theirs; each names
//! its own defaults and environment variables through [`ListenDefaults`]. Processes with an
//! admin server but no HTTP API (`kvpool master`) flatten [`AdminListenArgs`] alone.
//! Pure: parsing only.

use std::fmt::Debug;
use std::marker::PhantomData;
use std::net::SocketAddr;

use crate::http::{HttpLimitArgs, HttpLimits};

/// The defaults and environment variables of one service's listen flags; implemented by the
/// service's flags struct, which flattens a `ListenArgs<Self>`.
pub trait ListenDefaults: Clone + Debug + Send + Sync + 'static {
    /// Default of `--listen`.
    const LISTEN: &'static str;
    /// Environment variable of `--listen`.
    const LISTEN_ENV: &'static str;
    /// Default of `--admin-listen`.
    const ADMIN_LISTEN: &'static str;
    /// Environment variable of `--admin-listen`.
    const ADMIN_LISTEN_ENV: &'static str;
}

/// Implements [`ListenDefaults`] for a service's flags struct from its role name and default
/// addresses; the variables follow the house convention, `KVPOOL_<ROLE>_LISTEN` and
/// `KVPOOL_<ROLE>_ADMIN_LISTEN`, so no service can name them differently:
/// `listen_defaults!(EngineArgs, "ENGINE", "127.0.0.1:8000", "127.0.0.1:9100");`
#[macro_export]
macro_rules! listen_defaults {
    ($args:ty, $role:literal, $listen:literal, $admin_listen:literal) => {
        impl $crate::listen::ListenDefaults for $args {
            const LISTEN: &'static str = $listen;
            const LISTEN_ENV: &'static str = concat!("KVPOOL_", $role, "_LISTEN");
            const ADMIN_LISTEN: &'static str = $admin_listen;
            const ADMIN_LISTEN_ENV: &'static str = concat!("KVPOOL_", $role, "_ADMIN_LISTEN");
        }
    };
}

/// `--listen` and `--admin-listen`, with the defaults and variables of `D`.
#[derive(Debug, Clone, clap::Args)]
pub struct ListenArgs<D: ListenDefaults> {
    /// Address of the OpenAI-compatible API.
    #[arg(long, default_value = D::LISTEN, env = D::LISTEN_ENV)]
    pub listen: SocketAddr,
    /// Address of /livez, /readyz and /metrics.
    #[arg(long, default_value = D::ADMIN_LISTEN, env = D::ADMIN_LISTEN_ENV)]
    pub admin_listen: SocketAddr,
    /// Limits on the connections of both servers (slow and idle clients).
    #[command(flatten)]
    pub http: HttpLimitArgs,
    #[arg(skip)]
    defaults: PhantomData<D>,
}

/// Where a service listens and the limits of both its servers: [`ListenArgs`] once checked,
/// what `wiring::run` starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listening {
    /// The API listener's address (`--listen`).
    pub api: SocketAddr,
    /// The admin server's address (`--admin-listen`).
    pub admin: SocketAddr,
    /// Connection limits of both servers.
    pub http: HttpLimits,
}

impl<D: ListenDefaults> ListenArgs<D> {
    /// The checked addresses and limits, or the limit flag that is out of range (its long
    /// name) and what is wrong with it.
    pub fn listening(&self) -> Result<Listening, (&'static str, &'static str)> {
        Ok(Listening {
            api: self.listen,
            admin: self.admin_listen,
            http: self.http.limits()?,
        })
    }
}

/// The default and environment variable of `--admin-listen` for a process without an HTTP API
/// of its own (the master, the operator); implemented by the process's flags struct, which
/// flattens an `AdminListenArgs<Self>`.
pub trait AdminListenDefaults: Clone + Debug + Send + Sync + 'static {
    /// Default of `--admin-listen`.
    const ADMIN_LISTEN: &'static str;
    /// Environment variable of `--admin-listen`.
    const ADMIN_LISTEN_ENV: &'static str;
}

/// `--admin-listen` alone (with `--admin-addr`, its old spelling), with the default and
/// variable of `D`.
#[derive(Debug, Clone, clap::Args)]
pub struct AdminListenArgs<D: AdminListenDefaults> {
    /// Address of the admin server (/livez, /readyz, /metrics); `--admin-addr` is its old
    /// spelling.
    #[arg(
        long = "admin-listen",
        alias = "admin-addr",
        default_value = D::ADMIN_LISTEN,
        env = D::ADMIN_LISTEN_ENV
    )]
    pub admin_addr: SocketAddr,
    #[arg(skip)]
    defaults: PhantomData<D>,
}

impl<D: AdminListenDefaults> AdminListenArgs<D> {
    /// The flag set to `admin_addr` (for processes started in code rather than from a command
    /// line).
    pub fn new(admin_addr: SocketAddr) -> Self {
        Self {
            admin_addr,
            defaults: PhantomData,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(Clone, Debug)]
    struct Test;

    crate::listen_defaults!(Test, "RUNTIME_TEST", "127.0.0.1:1", "127.0.0.1:2");

    #[test]
    fn the_variables_follow_the_role_name() {
        assert_eq!(Test::LISTEN_ENV, "KVPOOL_RUNTIME_TEST_LISTEN");
        assert_eq!(Test::ADMIN_LISTEN_ENV, "KVPOOL_RUNTIME_TEST_ADMIN_LISTEN");
        assert_eq!(
            (Test::LISTEN, Test::ADMIN_LISTEN),
            ("127.0.0.1:1", "127.0.0.1:2")
        );
    }

    #[derive(Debug, Parser)]
    struct T {
        #[command(flatten)]
        addrs: ListenArgs<Test>,
    }

    #[test]
    fn defaults_apply_and_flags_override_them() {
        let t = T::try_parse_from(["t"]).unwrap();
        assert_eq!(t.addrs.listen, "127.0.0.1:1".parse().unwrap());
        assert_eq!(t.addrs.admin_listen, "127.0.0.1:2".parse().unwrap());
        let t =
            T::try_parse_from(["t", "--listen", "0.0.0.0:8", "--admin-listen", "[::1]:9"]).unwrap();
        assert_eq!(t.addrs.listen, "0.0.0.0:8".parse().unwrap());
        assert_eq!(t.addrs.admin_listen, "[::1]:9".parse().unwrap());
        assert!(T::try_parse_from(["t", "--listen", "nowhere"]).is_err());
    }

    /// A process with an admin server only, naming its own defaults as `kvpool master` does.
    #[derive(Clone, Debug, Parser)]
    struct AdminOnly {
        #[command(flatten)]
        admin: AdminListenArgs<AdminOnly>,
    }

    impl AdminListenDefaults for AdminOnly {
        const ADMIN_LISTEN: &'static str = "127.0.0.1:3";
        const ADMIN_LISTEN_ENV: &'static str = "KVPOOL_RUNTIME_TEST_ADMIN_ONLY_LISTEN";
    }

    #[test]
    fn admin_listen_alone_takes_its_default_and_its_old_spelling() {
        let parsed = AdminOnly::try_parse_from(["a"]).unwrap();
        assert_eq!(parsed.admin.admin_addr, "127.0.0.1:3".parse().unwrap());
        for flag in ["--admin-listen", "--admin-addr"] {
            let parsed = AdminOnly::try_parse_from(["a", flag, "[::1]:9"]).unwrap();
            assert_eq!(parsed.admin.admin_addr, "[::1]:9".parse().unwrap());
        }
        let help = AdminOnly::command().render_help().to_string();
        assert!(
            help.contains("[env: KVPOOL_RUNTIME_TEST_ADMIN_ONLY_LISTEN=]"),
            "{help}"
        );
        assert!(help.contains("[default: 127.0.0.1:3]"), "{help}");
    }

    #[test]
    fn help_names_the_defaults_and_variables() {
        let help = T::command().render_help().to_string();
        for part in [
            "--listen <LISTEN>",
            "--admin-listen <ADMIN_LISTEN>",
            "[env: KVPOOL_RUNTIME_TEST_LISTEN=]",
            "[env: KVPOOL_RUNTIME_TEST_ADMIN_LISTEN=]",
            "[default: 127.0.0.1:1]",
            "[default: 127.0.0.1:2]",
        ] {
            assert!(help.contains(part), "{part} not in {help}");
        }
    }
}
