//! The agent credential issuer's wire contract, between the operator (which serves it) and the
//! node agents (which call it once at start): an agent proves which pod it is, and therefore
//! which node it runs on, with a projected ServiceAccount token, and gets back the credential
//! file of the agent on that node (docs/adr/0009-node-bound-agent-credentials.md).
//!
//! ```text
//! POST /v1/agent-credentials          (HTTPS; the operator's CA is in the pool document)
//! Authorization: Bearer <projected ServiceAccount token, audience kvpool-agent-credentials>
//! Content-Type: application/json
//! {"namespace": "<pool namespace>", "pool": "<KVCachePool name>"}
//!
//! 200 application/json: the node's credential file ({"role":"agent","node":...,"master":...,
//!     "transfer":...}), as `kvpool auth derive --role agent --node` prints it
//! 400 / 401 / 403 / 404 / 503 application/json: {"reason": "<snake_case>", "message": "..."}
//! ```
//! Pure.

/// Audience of the projected token the agent presents; the issuer accepts no other.
pub const AUDIENCE: &str = "kvpool-agent-credentials";
/// Path of the issuing call.
pub const PATH: &str = "/v1/agent-credentials";
/// Port the operator serves the issuer on.
pub const PORT: u16 = 8443;
/// Most bytes of a request body the issuer reads, and of an answer the agent reads.
pub const MAX_BODY: usize = 16 * 1024;

/// What an agent asks for: the credential of its node in one pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IssueRequest {
    pub namespace: String,
    pub pool: String,
}

impl IssueRequest {
    /// The request body.
    pub fn to_json(&self) -> String {
        serde_json::json!({"namespace": self.namespace, "pool": self.pool}).to_string()
    }

    /// Parse a request body; the error names what is wrong.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let doc: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        let obj = doc.as_object().ok_or("the body is not a JSON object")?;
        if let Some(extra) = obj.keys().find(|k| *k != "namespace" && *k != "pool") {
            return Err(format!(
                "unknown field {:?} (expected namespace and pool)",
                extra.chars().take(64).collect::<String>()
            ));
        }
        let field = |name: &str| -> Result<String, String> {
            let v = obj
                .get(name)
                .and_then(serde_json::Value::as_str)
                .ok_or_else(|| format!("no {name:?} string"))?;
            if v.is_empty() || v.len() > 253 {
                return Err(format!("{name:?} is not a Kubernetes object name"));
            }
            Ok(v.to_owned())
        };
        Ok(Self {
            namespace: field("namespace")?,
            pool: field("pool")?,
        })
    }
}

/// An issuer's refusal body: `{"reason": ..., "message": ...}`.
pub fn refusal_json(reason: &str, message: &str) -> String {
    serde_json::json!({"reason": reason, "message": message}).to_string()
}

/// The `(reason, message)` of a refusal body, or the body's first bytes when it is not one.
pub fn parse_refusal(body: &[u8]) -> (String, String) {
    let doc: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let field = |name: &str| {
        doc.as_ref()
            .and_then(|d| d.get(name))
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
    };
    match (field("reason"), field("message")) {
        (Some(r), Some(m)) => (r, m),
        _ => (
            "unknown".to_owned(),
            String::from_utf8_lossy(&body[..body.len().min(256)]).into_owned(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_bodies_are_named() {
        let req = IssueRequest {
            namespace: "ml".into(),
            pool: "kv".into(),
        };
        assert_eq!(IssueRequest::parse(req.to_json().as_bytes()), Ok(req));
        for (body, needle) in [
            (&b"nope"[..], "not JSON"),
            (b"[]", "not a JSON object"),
            (b"{\"pool\":\"kv\"}", "\"namespace\""),
            (b"{\"namespace\":\"ml\",\"pool\":\"\"}", "\"pool\" is not"),
            (
                b"{\"namespace\":\"ml\",\"pool\":\"kv\",\"node\":\"x\"}",
                "unknown field \"node\"",
            ),
        ] {
            let err = IssueRequest::parse(body).expect_err("refused");
            assert!(err.contains(needle), "{err}");
        }
    }

    #[test]
    fn refusals_parse_and_foreign_bodies_are_shown() {
        let body = refusal_json("wrong_node", "no");
        assert_eq!(
            parse_refusal(body.as_bytes()),
            ("wrong_node".into(), "no".into())
        );
        assert_eq!(parse_refusal(b"<html>").1, "<html>");
    }
}
