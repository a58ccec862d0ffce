//! The vLLM venvs that `tests/python/setup.sh` makes (one per vLLM version, under
//! `$KVWIRE_PY_CACHE` or `~/.cache/kvwire-py`), found and, for the commands that need them,
//! installed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// How to install the venvs by hand.
pub const INSTALL_HINT: &str = "bash tests/python/setup.sh";

/// The setup script of this checkout (the binary is built from it).
pub fn setup_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/setup.sh")
}

/// The venv interpreters under the cache directory, newest vLLM first.
pub fn default_pythons() -> Vec<PathBuf> {
    let cache = std::env::var_os("KVWIRE_PY_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/kvwire-py")));
    let Some(cache) = cache else {
        return Vec::new();
    };
    let mut found: Vec<(Vec<u64>, PathBuf)> = std::fs::read_dir(&cache)
        .map(|d| {
            d.filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name().to_str()?.to_string();
                let ver = name.strip_prefix("vllm-")?;
                let py = e.path().join("bin/python");
                py.exists().then(|| {
                    let key = ver.split('.').map(|p| p.parse().unwrap_or(0)).collect();
                    (key, py)
                })
            })
            .collect()
        })
        .unwrap_or_default();
    found.sort_by(|a, b| b.0.cmp(&a.0));
    found.into_iter().map(|(_, p)| p).collect()
}

/// The venvs, installed first when there are none: says so on stderr (about 19 GB and several
/// minutes for both vLLM versions), runs the setup script, and reports how long it took.
/// `Err` says why there are still none.
pub fn ensure_pythons(who: &str) -> Result<Vec<PathBuf>, String> {
    let found = default_pythons();
    if !found.is_empty() {
        return Ok(found);
    }
    let script = setup_script();
    eprintln!(
        "{who}: no vLLM venv found: installing them with {} (two venvs, vLLM 0.33.0 and 0.18.1, \
         about 19 GB, several minutes; --no-vllm skips the vLLM parts)",
        script.display()
    );
    let t0 = Instant::now();
    let status = Command::new("bash")
        .arg(&script)
        .status()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    eprintln!(
        "{who}: {} finished in {:.0} s ({status})",
        script.display(),
        t0.elapsed().as_secs_f64()
    );
    if !status.success() {
        return Err(format!("{} failed ({status})", script.display()));
    }
    let found = default_pythons();
    if found.is_empty() {
        return Err(format!("{} ran but no venv is there", script.display()));
    }
    Ok(found)
}
