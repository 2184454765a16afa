//! The engine instances the conductor routes to ([`Engines`], by base URL, kept in a stable
//! order over changes) and the disaggregation convention each pair follows
//! ([`RoutingProtocol`]). Pure.

/// The disaggregated-serving convention the engines follow (docs/engine-contract.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoutingProtocol {
    /// vLLM's proxy: prefill first (`max_tokens: 1`, `kv_transfer_params`), then decode with
    /// the `kv_transfer_params` prefill returned.
    Vllm,
    /// vLLM's `MooncakeConnector` (P2P): prefill then decode, paired by a `transfer_id` the
    /// conductor makes, decode told the prefill instance's engine id (from its bootstrap server
    /// on `bootstrap_port`, vLLM's `VLLM_MOONCAKE_BOOTSTRAP_PORT`) and bootstrap address.
    VllmMooncake { bootstrap_port: u16 },
    /// SGLang's router: the same request to prefill and decode at once, paired by
    /// `bootstrap_host`, `bootstrap_port` (this one, the prefill engines' bootstrap server) and
    /// a random `bootstrap_room`.
    Sglang { bootstrap_port: u16 },
}

impl RoutingProtocol {
    /// The convention's name, as in `--engine-protocol` and the pod annotation.
    pub fn name(self) -> &'static str {
        match self {
            RoutingProtocol::Vllm => "vllm",
            RoutingProtocol::VllmMooncake { .. } => "vllm-mooncake",
            RoutingProtocol::Sglang { .. } => "sglang",
        }
    }
}

/// `--engine-protocol`: the convention of engines that declare none (their bootstrap port, where
/// one is needed, is `--bootstrap-port`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ConductorProtocol {
    /// [`RoutingProtocol::Vllm`].
    Vllm,
    /// [`RoutingProtocol::VllmMooncake`].
    VllmMooncake,
    /// [`RoutingProtocol::Sglang`].
    Sglang,
}

impl ConductorProtocol {
    /// The convention, with `bootstrap_port` where it needs one.
    pub fn routing(self, bootstrap_port: u16) -> RoutingProtocol {
        match self {
            ConductorProtocol::Vllm => RoutingProtocol::Vllm,
            ConductorProtocol::VllmMooncake => RoutingProtocol::VllmMooncake { bootstrap_port },
            ConductorProtocol::Sglang => RoutingProtocol::Sglang { bootstrap_port },
        }
    }
}

/// The engine instances the conductor routes to, by base URL.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Engines {
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
    /// The routing convention of engines that declare one (discovered pods carry the
    /// `kvpool.dev/engine-protocol` annotation), by base URL; the others follow
    /// [`ConductorConfig::protocol`].
    pub protocols: std::collections::BTreeMap<String, RoutingProtocol>,
}

impl Engines {
    /// At least one of each role.
    pub fn is_complete(&self) -> bool {
        !self.prefill.is_empty() && !self.decode.is_empty()
    }

    /// `next` ordered so that engines present in `self` keep their relative order and come
    /// first, and new ones follow in `next`'s order: indices change as little as possible.
    pub fn stable_order(&self, next: &Engines) -> Engines {
        fn order(old: &[String], new: &[String]) -> Vec<String> {
            let mut out: Vec<String> = old.iter().filter(|u| new.contains(u)).cloned().collect();
            for u in new {
                if !out.contains(u) {
                    out.push(u.clone());
                }
            }
            out
        }
        Engines {
            prefill: order(&self.prefill, &next.prefill),
            decode: order(&self.decode, &next.decode),
            protocols: next.protocols.clone(),
        }
    }

    /// How to route a request to the pair (`prefill`, `decode`): the protocol both declare, or
    /// `default` for an engine that declares none. A pair whose engines declare different
    /// conventions cannot be served (their KV hand-offs do not meet); the error says which.
    pub fn pair_protocol(
        &self,
        prefill: &str,
        decode: &str,
        default: RoutingProtocol,
    ) -> Result<RoutingProtocol, String> {
        let p = self.protocols.get(prefill).copied().unwrap_or(default);
        let d = self.protocols.get(decode).copied().unwrap_or(default);
        match (p, d) {
            (RoutingProtocol::Vllm, RoutingProtocol::Vllm) => Ok(p),
            // The bootstrap server is the prefill engine's.
            (RoutingProtocol::VllmMooncake { .. }, RoutingProtocol::VllmMooncake { .. }) => Ok(p),
            // The bootstrap server is the prefill engine's.
            (RoutingProtocol::Sglang { .. }, RoutingProtocol::Sglang { .. }) => Ok(p),
            _ => Err(format!(
                "prefill engine {prefill} speaks {} but decode engine {decode} speaks {}: the \
                 engine pools of one KVCachePool must share engine.kind",
                p.name(),
                d.name()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_is_routed_by_the_protocol_both_engines_declare() {
        let sg = |port| RoutingProtocol::Sglang {
            bootstrap_port: port,
        };
        let engines = Engines {
            prefill: vec![
                "http://p-sg".into(),
                "http://p-v".into(),
                "http://p-none".into(),
            ],
            decode: vec![
                "http://d-sg".into(),
                "http://d-v".into(),
                "http://d-none".into(),
            ],
            protocols: [
                ("http://p-sg".to_owned(), sg(9000)),
                ("http://d-sg".to_owned(), sg(8998)),
                ("http://p-v".to_owned(), RoutingProtocol::Vllm),
                ("http://d-v".to_owned(), RoutingProtocol::Vllm),
            ]
            .into_iter()
            .collect(),
        };
        let v = RoutingProtocol::Vllm;
        // The bootstrap port is the prefill engine's.
        assert_eq!(
            engines.pair_protocol("http://p-sg", "http://d-sg", v),
            Ok(sg(9000))
        );
        assert_eq!(
            engines.pair_protocol("http://p-v", "http://d-v", sg(1)),
            Ok(v)
        );
        // vLLM's MooncakeConnector pairs take the prefill engine's bootstrap port too.
        let vm = |port| RoutingProtocol::VllmMooncake {
            bootstrap_port: port,
        };
        let mut mooncake = engines.clone();
        mooncake
            .protocols
            .insert("http://p-none".to_owned(), vm(8100));
        mooncake
            .protocols
            .insert("http://d-none".to_owned(), vm(8998));
        assert_eq!(
            mooncake.pair_protocol("http://p-none", "http://d-none", v),
            Ok(vm(8100))
        );
        assert!(
            mooncake
                .pair_protocol("http://p-none", "http://d-v", v)
                .unwrap_err()
                .contains("speaks vllm-mooncake but decode engine http://d-v speaks vllm")
        );
        // Undeclared engines take the conductor's default.
        assert_eq!(
            engines.pair_protocol("http://p-none", "http://d-none", v),
            Ok(v)
        );
        assert_eq!(
            engines.pair_protocol("http://p-none", "http://d-sg", sg(7)),
            Ok(sg(7))
        );
        let e = engines
            .pair_protocol("http://p-v", "http://d-sg", v)
            .expect_err("mixed pair");
        assert!(
            e.contains("http://p-v") && e.contains("vllm") && e.contains("sglang"),
            "{e}"
        );
        assert!(
            engines
                .pair_protocol("http://p-none", "http://d-sg", v)
                .is_err()
        );
        // A new engine set keeps the declared protocols.
        let kept = Engines::default().stable_order(&engines);
        assert_eq!(kept.protocols, engines.protocols);
    }
}
