//! The node agent's configuration: its YAML file (`config::parse`, then `config::validate`)
//! and the pool document the operator writes into the ConfigMap (`parse_pool_document`, then
//! `from_pool_document` and `validate`). Bad input is an error naming what is wrong, never a
//! panic or a runaway allocation; a valid config validates the same way twice.
#![no_main]

use std::path::Path;

use kvpool_agent::config::{self, from_pool_document, parse_pool_document};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("fuzz.yaml");
    if let Ok(file) = config::parse(text, path) {
        check(&file);
    }
    if let Ok(doc) = parse_pool_document(text, path)
        && let Ok(file) = from_pool_document(&doc, 64 << 30)
    {
        check(&file);
    }
});

fn check(file: &config::FileConfig) {
    match config::validate(file) {
        Ok(cfg) => {
            let again = config::validate(file).expect("validates twice");
            assert_eq!(format!("{cfg:?}"), format!("{again:?}"));
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
}
