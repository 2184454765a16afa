//! Logging set-up shared by the binaries: `tracing` to stderr, filtered by `RUST_LOG`
//! (default `info`), as text or JSON lines. Text is coloured only when stderr is a terminal and
//! neither `NO_COLOR` nor `TERM=dumb` asks otherwise, so that files, pipes and `kubectl logs`
//! never carry escape codes. I/O boundary: [`init`] reads the environment and whether stderr
//! is a terminal; [`colour`] decides from those facts alone.

use std::ffi::OsStr;
use std::io::IsTerminal as _;

use tracing_subscriber::EnvFilter;

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// What decides whether log lines are coloured.
#[derive(Clone, Copy, Debug)]
pub struct Output<'a> {
    pub format: LogFormat,
    /// Whether the stream the logs go to is a terminal.
    pub terminal: bool,
    /// The value of `NO_COLOR`, if set.
    pub no_color: Option<&'a OsStr>,
    /// The value of `TERM`, if set.
    pub term: Option<&'a OsStr>,
}

/// Whether to write ANSI colour codes: text logs on a terminal only, and not when `NO_COLOR`
/// is set to a non-empty value (no-color.org) or the terminal is `dumb`. JSON never.
pub fn colour(output: Output<'_>) -> bool {
    output.format == LogFormat::Text
        && output.terminal
        && output.no_color.is_none_or(OsStr::is_empty)
        && output.term.is_none_or(|t| t != "dumb")
}

/// Install the global subscriber. Calling it twice is harmless (the second call is ignored).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let no_color = std::env::var_os("NO_COLOR");
    let term = std::env::var_os("TERM");
    let ansi = colour(Output {
        format,
        terminal: std::io::stderr().is_terminal(),
        no_color: no_color.as_deref(),
        term: term.as_deref(),
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn output(
        terminal: bool,
        no_color: Option<&'static str>,
        term: Option<&'static str>,
    ) -> Output<'static> {
        Output {
            format: LogFormat::Text,
            terminal,
            no_color: no_color.map(OsStr::new),
            term: term.map(OsStr::new),
        }
    }

    #[test]
    fn text_on_a_terminal_is_coloured() {
        assert!(colour(output(true, None, Some("xterm-256color"))));
        assert!(colour(output(true, None, None)), "no TERM is not dumb");
    }

    #[test]
    fn files_and_pipes_are_never_coloured() {
        assert!(!colour(output(false, None, Some("xterm-256color"))));
        assert!(!colour(output(false, None, None)));
    }

    #[test]
    fn no_color_and_a_dumb_terminal_turn_colour_off() {
        assert!(!colour(output(true, Some("1"), Some("xterm"))));
        assert!(!colour(output(true, Some("0"), Some("xterm"))), "any value");
        assert!(!colour(output(true, None, Some("dumb"))));
        // An empty NO_COLOR does not count (no-color.org).
        assert!(colour(output(true, Some(""), Some("xterm"))));
    }

    #[test]
    fn json_is_never_coloured() {
        let mut json = output(true, None, Some("xterm"));
        json.format = LogFormat::Json;
        assert!(!colour(json));
    }
}

/// An error and its causes on one line, joined with ": " — what every log line that reports a
/// failure prints (`error = %chain(&e)`), so that a "cannot get KVCachePool" says why (the 403
/// and its message) without a second line. A cause whose text the line already holds (an
/// error that prints its source in its own message) is not repeated.
pub fn chain<'a>(error: &'a (dyn std::error::Error + 'a)) -> ErrorChain<'a> {
    ErrorChain(error)
}

/// See [`chain`].
#[derive(Clone, Copy, Debug)]
pub struct ErrorChain<'a>(pub &'a (dyn std::error::Error + 'a));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut line = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            if !text.is_empty() && !line.contains(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
            cause = c.source();
        }
        f.write_str(&line)
    }
}

#[cfg(test)]
mod chain_tests {
    use super::chain;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("cannot get KVCachePool llm/cache")]
        Get(#[source] Middle),
        #[error("cannot read the key: {0}")]
        Echoing(#[source] std::io::Error),
    }

    #[derive(Debug, thiserror::Error)]
    #[error("ApiError: forbidden (403)")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn causes_follow_on_one_line_without_repeats() {
        let denied = || std::io::Error::new(std::io::ErrorKind::PermissionDenied, "RBAC: no get");
        assert_eq!(
            chain(&Outer::Get(Middle(denied()))).to_string(),
            "cannot get KVCachePool llm/cache: ApiError: forbidden (403): RBAC: no get"
        );
        assert_eq!(
            chain(&Outer::Echoing(denied())).to_string(),
            "cannot read the key: RBAC: no get"
        );
        assert_eq!(chain(&denied()).to_string(), "RBAC: no get");
    }
}
