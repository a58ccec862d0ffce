//! The files of `transfer/src` are layered: no circle of files imports each other (see
//! `kvwire_testkit::layering`).

use std::path::Path;

#[test]
fn no_circle_of_files_in_transfer_src() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let cycles = kvwire_testkit::layering::file_cycles(&src).expect("transfer/src reads");
    assert!(cycles.is_empty(), "files importing each other: {cycles:?}");
}
