//! Generated gRPC types of `proto/agent/v1/engine.proto` (client and server). Pure.

#![allow(clippy::all, clippy::pedantic, missing_docs)]

tonic::include_proto!("kvpool.agent.v1");
