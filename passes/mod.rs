//! Registered passes, one file each. Each file ends with `inventory::submit!`; nothing outside
//! this folder names a concrete pass.

pub mod attn;
pub mod capture;
pub mod fakequant;
pub mod lowrank;
pub mod matmul;
pub mod online;
pub mod residual;
pub mod route;
pub mod sample;
pub mod skip;
pub mod smoothquant;
pub mod sparseattn;
pub mod staticquant;

/// Make sure every pass file is linked. A static library member is only linked when something
/// references it, and `inventory` registrations are never referenced by name: without this, a
/// program that links opscope with just `use opscope as _;` saw `matmul` but not the passes in
/// other files (measured with the `mlp` example). The crate's load-time constructor calls it.
pub fn link() {
    std::hint::black_box([attn::link as fn(), capture::link, fakequant::link, lowrank::link, matmul::link, online::link, residual::link, route::link, sample::link, skip::link, smoothquant::link, sparseattn::link, staticquant::link]);
}
