//! The library crates are layered: no circle of files in their `src` imports each other (see
//! `kvwire_testkit::layering`).
//!
//! Two are left out on purpose. `ffi` is Python glue whose classes refer to each other (an
//! engine opens a layer stream or a CUDA stager, and each holds its engine). The test kit's
//! simulator (`sim`) is one state whose event loop, dispatch and reports are split by concern
//! into files that call each other's methods; a path-level layering there would only hide that.

use std::path::Path;

#[test]
fn no_circle_of_files_in_the_library_crates() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let crates = [
        "transfer",
        "transfer/verbs",
        "transfer/verbs/loopback",
        "connector",
        "microbench",
    ];
    let mut found = Vec::new();
    for c in crates {
        let src = root.join(c).join("src");
        let cycles = kvwire_testkit::layering::file_cycles(&src)
            .unwrap_or_else(|e| panic!("{}: {e}", src.display()));
        found.extend(cycles.into_iter().map(|cy| (c, cy)));
    }
    assert!(found.is_empty(), "files importing each other: {found:#?}");
}
