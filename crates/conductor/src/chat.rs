//! Chat requests rendered as the engine renders them: the model's Hugging Face chat template
//! (Jinja, from `tokenizer_config.json`, a `chat_template.jinja` beside it, or `--chat-template`)
//! run with minijinja in the settings `transformers` uses (`trim_blocks`, `lstrip_blocks`, the
//! Python string methods, `raise_exception`, `strftime_now`), so that the prompt's token ids,
//! and with them its block hashes, are the engine's. The I/O boundary is [`ChatTemplate::load`],
//! which reads the files once at start; rendering is pure but for `strftime_now`'s clock.

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use serde_json::Value as Json;

use kvpool_proto::openai::ChatInput;

/// Name of the template inside the environment.
const TEMPLATE: &str = "chat";
/// Fuel (minijinja instructions) one rendering may spend: far above any real template over a
/// long conversation, low enough that a template looping forever fails instead of hanging.
const FUEL: u64 = 50_000_000;

/// Errors of loading or rendering a chat template.
#[derive(Debug, thiserror::Error, strum::IntoStaticStr)]
#[strum(serialize_all = "snake_case")]
pub enum ChatError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path} has no usable chat_template (a string, or a list of {{name, template}})")]
    NoTemplate { path: PathBuf },
    #[error("the chat template does not compile: {0:#}")]
    Compile(#[source] JinjaError),
    #[error("the chat template failed on this request: {0:#}")]
    Render(#[source] JinjaError),
}

kvpool_runtime::error_category!(ChatError);

/// A compiled chat template with the special tokens it may refer to.
#[derive(derive_more::Debug)]
pub struct ChatTemplate {
    #[debug(skip)]
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source` (a Jinja chat template) with the model's BOS and EOS token text.
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(ChatError::Compile)?;
        env.set_syntax(syntax);
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE, source)
            .map_err(ChatError::Compile)?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Loads the model's template: `template` when given (a `.jinja` file, or a
    /// `tokenizer_config.json`), else from `model_dir` its `chat_template.jinja` or its
    /// `tokenizer_config.json`'s `chat_template`. The BOS and EOS tokens come from the
    /// `tokenizer_config.json` found either way. `Ok(None)`: neither holds a template.
    pub fn load(
        template: Option<&Path>,
        model_dir: Option<&Path>,
    ) -> Result<Option<Self>, ChatError> {
        let config_path = model_dir
            .map(|d| d.join("tokenizer_config.json"))
            .filter(|p| p.is_file())
            .or_else(|| template.filter(|t| is_json(t)).map(Path::to_path_buf));
        let config = config_path
            .as_deref()
            .map(|p| read_json(p).map(|v| (p.to_path_buf(), v)))
            .transpose()?;
        let source = match (template, model_dir) {
            (Some(t), _) if is_json(t) => {
                // Read above already when it is also the config (no model directory).
                let v = match &config {
                    Some((path, v)) if path == t => v.clone(),
                    _ => read_json(t)?,
                };
                Some(template_of(&v).ok_or_else(|| ChatError::NoTemplate {
                    path: t.to_path_buf(),
                })?)
            }
            (Some(t), _) => Some(read(t)?),
            (None, Some(dir)) if dir.join("chat_template.jinja").is_file() => {
                Some(read(&dir.join("chat_template.jinja"))?)
            }
            (None, Some(_)) => config.as_ref().and_then(|(_, v)| template_of(v)),
            (None, None) => None,
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let token = |name: &str| {
            config
                .as_ref()
                .and_then(|(_, v)| token_text(v.get(name)))
                .unwrap_or_default()
        };
        Self::new(source, token("bos_token"), token("eos_token")).map(Some)
    }

    /// The prompt text of a chat request, as `transformers`' `apply_chat_template(...,
    /// tokenize=False)` makes it.
    pub fn render(&self, chat: &ChatInput) -> Result<String, ChatError> {
        let template = self.env.get_template(TEMPLATE).map_err(ChatError::Render)?;
        let mut ctx = serde_json::Map::new();
        // Request keywords first, so that the fixed names below win.
        for (k, v) in &chat.template_kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), chat.messages.clone());
        if let Some(tools) = &chat.tools {
            ctx.insert("tools".into(), tools.clone());
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(chat.add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        template
            .render(Value::from(Serde(&Json::Object(ctx))))
            .map_err(ChatError::Render)
    }
}

fn is_json(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
}

fn read(path: &Path) -> Result<String, ChatError> {
    std::fs::read_to_string(path).map_err(|source| ChatError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn read_json(path: &Path) -> Result<Json, ChatError> {
    serde_json::from_str(&read(path)?).map_err(|source| ChatError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// `chat_template` of a `tokenizer_config.json`: a string, or a list of named templates of
/// which the one named `default` is used.
fn template_of(config: &Json) -> Option<String> {
    match config.get("chat_template")? {
        Json::String(s) => Some(s.clone()),
        Json::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

/// A special token as `tokenizer_config.json` writes it: a string, or an added-token object
/// with `content`.
fn token_text(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// `raise_exception(message)`: templates call it to refuse a conversation they cannot render.
fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current time (UTC) formatted with C `strftime` directives.
fn strftime_now(format: String, _kwargs: Kwargs) -> Result<Value, JinjaError> {
    let now = jiff::Timestamp::now().to_zoned(jiff::tz::TimeZone::UTC);
    // jiff refuses a directive it does not know (an error, not a panic).
    jiff::fmt::strtime::format(format.as_bytes(), &now)
        .map(Value::from)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A ChatML-style template with the features real ones use: a system default, a loop with
    /// `loop.first`, whitespace control, string methods, `raise_exception`.
    const CHATML: &str = "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}\
{% for message in messages %}\
{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + message['role']) }}{% endif %}\
<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n\
{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn chat(messages: Json, add_generation_prompt: bool) -> ChatInput {
        ChatInput {
            messages,
            tools: None,
            add_generation_prompt,
            template_kwargs: Default::default(),
        }
    }

    fn template(src: &str) -> ChatTemplate {
        ChatTemplate::new(src.into(), "<s>".into(), "</s>".into()).expect("compiles")
    }

    #[test]
    fn chatml_renders_like_transformers() {
        let t = template(CHATML);
        let got = t
            .render(&chat(
                json!([{"role": "user", "content": " hi there "}]),
                true,
            ))
            .unwrap();
        assert_eq!(
            got,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_prompt = t
            .render(&chat(
                json!([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]),
                false,
            ))
            .unwrap();
        assert_eq!(
            no_prompt,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_follow_jinja2() {
        // Jinja2 with trim_blocks drops the newline after a block tag; lstrip_blocks drops the
        // indentation before one.
        let t = template(
            "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}",
        );
        let got = t
            .render(&chat(
                json!([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]),
                true,
            ))
            .unwrap();
        assert_eq!(got, "[a]\n");
    }

    #[test]
    fn special_tokens_python_methods_and_kwargs_reach_the_template() {
        let t = template(
            "{{ bos_token }}{% for m in messages %}{{ m.content.upper() }}|{{ m.content.startswith('h') }}{% endfor %}{% if enable_thinking %}<think>{% endif %}{{ eos_token }}",
        );
        let mut c = chat(json!([{"role": "user", "content": "hello"}]), true);
        c.template_kwargs
            .insert("enable_thinking".into(), json!(true));
        // Booleans print as Python prints them, as in Jinja2.
        assert_eq!(t.render(&c).unwrap(), "<s>HELLO|True<think></s>");
        // Fixed names win over request keywords.
        c.template_kwargs.insert("bos_token".into(), json!("X"));
        assert!(t.render(&c).unwrap().starts_with("<s>"));
    }

    #[test]
    fn a_refused_conversation_names_the_reason() {
        let t = template(CHATML);
        let err = t
            .render(&chat(json!([{"role": "wizard", "content": "x"}]), true))
            .unwrap_err();
        assert_eq!(err.category(), "render");
        assert!(err.to_string().contains("unknown role wizard"), "{err}");
    }

    #[test]
    fn a_broken_or_endless_template_fails_cleanly() {
        let err = ChatTemplate::new("{% for %}".into(), String::new(), String::new()).unwrap_err();
        assert_eq!(err.category(), "compile");
        let endless = template("{% for i in range(100000000) %}{{ i }}{% endfor %}");
        let err = endless
            .render(&chat(json!([{"role": "user", "content": "x"}]), true))
            .unwrap_err();
        assert_eq!(err.category(), "render");
    }

    #[test]
    fn strftime_now_formats_the_current_date() {
        let t = template("{{ strftime_now('%Y') }}");
        let year = t
            .render(&chat(json!([{"role": "user", "content": "x"}]), true))
            .unwrap();
        assert_eq!(year.len(), 4);
        assert!(year.starts_with("20"), "{year}");
    }

    #[test]
    fn templates_load_from_a_model_directory_or_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let config = json!({
            "bos_token": {"content": "<|begin|>", "lstrip": false},
            "eos_token": "<|end|>",
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}
            ]
        });
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            serde_json::to_vec(&config).unwrap(),
        )
        .unwrap();
        let c = chat(json!([{"role": "user", "content": "q"}]), true);
        let from_dir = ChatTemplate::load(None, Some(dir.path())).unwrap().unwrap();
        assert_eq!(from_dir.render(&c).unwrap(), "<|begin|>q<|end|>");
        // A standalone chat_template.jinja beside it takes precedence.
        std::fs::write(dir.path().join("chat_template.jinja"), "J{{ bos_token }}").unwrap();
        let jinja = ChatTemplate::load(None, Some(dir.path())).unwrap().unwrap();
        assert_eq!(jinja.render(&c).unwrap(), "J<|begin|>");
        // --chat-template overrides both.
        let own = dir.path().join("own.jinja");
        std::fs::write(&own, "own:{{ messages | length }}").unwrap();
        let t = ChatTemplate::load(Some(&own), Some(dir.path()))
            .unwrap()
            .unwrap();
        assert_eq!(t.render(&c).unwrap(), "own:1");
        // No template anywhere: none.
        let empty = tempfile::tempdir().unwrap();
        assert!(
            ChatTemplate::load(None, Some(empty.path()))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn unreadable_or_template_less_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.jinja");
        let err = ChatTemplate::load(Some(&missing), None).unwrap_err();
        assert!(err.to_string().contains("missing.jinja"), "{err}");
        let bad = dir.path().join("tokenizer_config.json");
        std::fs::write(&bad, "{\"chat_template\": 7}").unwrap();
        let err = ChatTemplate::load(Some(&bad), None).unwrap_err();
        assert_eq!(err.category(), "no_template");
        std::fs::write(&bad, "{nope").unwrap();
        assert_eq!(
            ChatTemplate::load(Some(&bad), None).unwrap_err().category(),
            "json"
        );
    }
}
