//! The model names the conductor serves ([`ServedModels`]): those given with `--model`, or,
//! without any, those the engines list on their own `/v1/models` (vLLM's and SGLang's served
//! model names), asked when a request names a model not known yet, when `/v1/models` is read
//! and when an engine has not answered yet, at most once a second. Each engine's answer also
//! says which engines a request may go to ([`ServedModels::eligible`]: those serving its
//! model). I/O boundary: the GETs to the engines.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::Request;
use serde_json::Value;

use super::upstream::{Upstream, engine_url, read_body};
use kvpool_core::sched::Eligible;

/// Longest wait for one engine's model list.
const LIST_TIMEOUT: Duration = Duration::from_secs(2);
/// Engines are asked again at most this often.
const REFRESH_EVERY: Duration = Duration::from_secs(1);

/// Served model names: fixed by flags, or learnt from the engines.
#[derive(Debug, Default)]
pub(super) struct ServedModels {
    fixed: Vec<String>,
    /// Each engine's answer, by base URL (engines that did not answer are absent).
    learnt: parking_lot::Mutex<BTreeMap<String, Vec<String>>>,
    asked: parking_lot::Mutex<Option<Instant>>,
}

impl ServedModels {
    pub(super) fn new(fixed: Vec<String>) -> Self {
        Self {
            fixed,
            ..Self::default()
        }
    }

    /// The names served now, in order: the flags', or the engines' (sorted, no duplicates).
    pub(super) fn names(&self) -> Vec<String> {
        if !self.fixed.is_empty() {
            return self.fixed.clone();
        }
        let mut all: Vec<String> = self.learnt.lock().values().flatten().cloned().collect();
        all.sort();
        all.dedup();
        all
    }

    pub(super) fn serves(&self, model: &str) -> bool {
        if !self.fixed.is_empty() {
            return self.fixed.iter().any(|m| m == model);
        }
        self.learnt.lock().values().flatten().any(|m| m == model)
    }

    /// Whether the names come from the engines (no `--model`).
    pub(super) fn learns(&self) -> bool {
        self.fixed.is_empty()
    }

    /// Whether requests are routed by each engine's model list: unless `--model` names exactly
    /// one model (then every engine serves it, whatever it lists).
    fn routes_by_engine(&self) -> bool {
        self.fixed.len() != 1
    }

    /// Whether routing needs a list one of `engines` has not given yet.
    pub(super) fn missing(&self, engines: &[String]) -> bool {
        let learnt = self.learnt.lock();
        self.routes_by_engine() && engines.iter().any(|e| !learnt.contains_key(e))
    }

    /// The engines a request for `model` may go to: those that list it, those that have not
    /// listed their models (yet, or cannot), and, with `--model` names, those whose list names
    /// none of them (they serve the flags' names under other names: no telling). `None` for a
    /// role whose engines may all take it.
    pub(super) fn eligible(&self, model: &str, engines: &crate::engines::Engines) -> Eligible {
        if !self.routes_by_engine() {
            return Eligible::default();
        }
        let learnt = self.learnt.lock();
        let takes = |names: &Vec<String>| {
            names.iter().any(|n| n == model)
                || (!self.fixed.is_empty() && !names.iter().any(|n| self.fixed.contains(n)))
        };
        let mask = |urls: &[String]| {
            let m: Vec<bool> = urls
                .iter()
                .map(|u| learnt.get(u).is_none_or(takes))
                .collect();
            (!m.iter().all(|ok| *ok)).then_some(m)
        };
        Eligible {
            prefill: mask(&engines.prefill),
            decode: mask(&engines.decode),
        }
    }

    /// Each engine's answer, by base URL (for the status page).
    pub(super) fn by_engine(&self) -> BTreeMap<String, Vec<String>> {
        self.learnt.lock().clone()
    }

    /// Keeps only the answers of `engines` (the engines served now).
    fn retain(&self, engines: &[String]) {
        self.learnt.lock().retain(|url, _| engines.contains(url));
    }
}

/// Asks every engine of `engines` for its model list (when the last round is over a second
/// old); answers replace the previous ones, engines that left are forgotten. With `--model`
/// the names served stay the flags', and the answers only say where each name is served.
pub(super) async fn refresh(models: &ServedModels, upstream: &Upstream, engines: Vec<String>) {
    {
        let mut asked = models.asked.lock();
        if asked.is_some_and(|t| t.elapsed() < REFRESH_EVERY) {
            return;
        }
        *asked = Some(Instant::now());
    }
    models.retain(&engines);
    let answers = futures::future::join_all(engines.iter().map(|e| list(upstream, e))).await;
    let mut learnt = models.learnt.lock();
    for (engine, answer) in engines.into_iter().zip(answers) {
        match answer {
            Ok(names) => {
                learnt.insert(engine, names);
            }
            Err(problem) => {
                tracing::debug!(%engine, %problem, "engine did not list its models");
            }
        }
    }
}

/// The `id`s of one engine's `/v1/models`.
async fn list(upstream: &Upstream, engine: &str) -> Result<Vec<String>, String> {
    let url = engine_url(engine, "/v1/models");
    let req = Request::get(&url)
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let call = async {
        let resp = upstream
            .request(url.clone(), req)
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("status {}", resp.status()));
        }
        let body = read_body(url.clone(), resp.into_body())
            .await
            .map_err(|e| e.to_string())?;
        model_ids(&body).ok_or_else(|| "not an OpenAI model list".to_owned())
    };
    tokio::time::timeout(LIST_TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {LIST_TIMEOUT:?}"))?
}

/// The ids of an OpenAI `/v1/models` body (`{"data": [{"id": ...}, ...]}`).
fn model_ids(body: &[u8]) -> Option<Vec<String>> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v.get("data")?
        .as_array()?
        .iter()
        .map(|m| m.get("id")?.as_str().map(str::to_owned))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_lists_are_read_from_the_openai_shape() {
        assert_eq!(
            model_ids(br#"{"object":"list","data":[{"id":"a","object":"model"},{"id":"b"}]}"#),
            Some(vec!["a".to_owned(), "b".to_owned()])
        );
        assert_eq!(model_ids(br#"{"data":[{"name":"a"}]}"#), None);
        assert_eq!(model_ids(b"not json"), None);
        assert_eq!(model_ids(br#"{"data":{}}"#), None);
    }

    #[test]
    fn flags_fix_the_names_else_the_engines_answers_count() {
        let fixed = ServedModels::new(vec!["x".into()]);
        assert!(fixed.serves("x") && !fixed.serves("y") && !fixed.learns());
        let learnt = ServedModels::new(vec![]);
        assert!(!learnt.serves("x") && learnt.names().is_empty());
        learnt
            .learnt
            .lock()
            .insert("http://p".into(), vec!["m2".into(), "m1".into()]);
        learnt
            .learnt
            .lock()
            .insert("http://d".into(), vec!["m1".into()]);
        assert_eq!(learnt.names(), vec!["m1".to_owned(), "m2".to_owned()]);
        assert!(learnt.serves("m2"));
        // A request for m2 may go to the engines that list it and to those that did not
        // answer (http://q); every decode engine lists m1, so no decode mask for m1.
        let engines = crate::engines::Engines {
            prefill: vec!["http://p".into(), "http://q".into(), "http://d".into()],
            decode: vec!["http://d".into()],
            ..Default::default()
        };
        let m2 = learnt.eligible("m2", &engines);
        assert_eq!(m2.prefill, Some(vec![true, true, false]));
        assert_eq!(m2.decode, Some(vec![false]));
        assert_eq!(learnt.eligible("m1", &engines).decode, None);
        assert!(learnt.missing(&engines.prefill));
        assert!(!learnt.missing(&engines.decode));
        // One --model name: every engine serves it, nothing to ask or restrict.
        let one = ServedModels::new(vec!["m2".into()]);
        one.learnt
            .lock()
            .insert("http://d".into(), vec!["m1".into()]);
        assert_eq!(one.eligible("m2", &engines), Eligible::default());
        assert!(!one.missing(&engines.prefill));
        // Several: an engine listing none of them (an alias) may take any.
        let two = ServedModels::new(vec!["m1".into(), "m2".into()]);
        two.learnt
            .lock()
            .insert("http://p".into(), vec!["m1".into()]);
        two.learnt
            .lock()
            .insert("http://d".into(), vec!["other".into()]);
        let m2 = two.eligible("m2", &engines);
        assert_eq!(m2.prefill, Some(vec![false, true, true]));
        assert_eq!(m2.decode, None);
        learnt.retain(&["http://d".to_owned()]);
        assert_eq!(learnt.names(), vec!["m1".to_owned()]);
    }
}
