//! Arbitrary text as a shard set's parameter layouts: validation, and unsharding empty
//! shards with them, return errors, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

fuzz_target!(|data: &[u8]| {
    let Ok(layouts) = serde_json::from_slice::<Vec<weft_passes::tp::ParamLayout>>(data) else {
        return;
    };
    let axes = vec![("tp".to_string(), 2u32)];
    let _ = weft_passes::tp::layout::validate_layouts(&layouts, &axes);
    let _ = weft_passes::tp::unshard_checkpoint(&layouts, &[BTreeMap::new(), BTreeMap::new()], &axes);
});
