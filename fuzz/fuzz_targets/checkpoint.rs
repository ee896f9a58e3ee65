//! Decodes a checkpoint as read from a damaged or hostile device: errors are fine,
//! a panic, an abort or an allocation out of proportion to the input is a bug.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    lamina_format::fuzzing::decode(lamina_format::fuzzing::Kind::Checkpoint, data);
});
