//! Byte views of numeric slices, for hashing a tensor or a sketch without copying it. A leaf
//! module: the sketch kernel, the weight memo, the online state and the writer all hash f32
//! slices, and none of them may import another for it (`tests/architecture.rs` refuses cycles).

/// The bytes of `v` as it lies in memory (little-endian f32 bits on every target RLX runs on):
/// `4 * v.len()` bytes, borrowed.
pub(crate) fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding or invalid bit patterns; the slice covers exactly `v`'s memory,
    // read-only, for the lifetime of the borrow.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
