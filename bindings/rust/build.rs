// Links libdevbridge_c and writes what the C compiler says about the
// header's structs and constants, so a test can hold src/sys.rs to it.
//
// The probe is generated from the header's own text (every `typedef struct`
// and every valued `#define DEVBRIDGE_`), so a field or constant added there
// shows up in the comparison without anyone remembering to list it.
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const LIB_DIR_VAR: &str = "DEVBRIDGE_C_LIB_DIR";

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let repo_root = manifest_dir.join("../..");
    let include_dir = repo_root.join("include");
    let header = include_dir.join("devbridge/c/devbridge.h");

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={}", header.display());
    println!("cargo:rerun-if-env-changed={}", LIB_DIR_VAR);
    println!("cargo:rerun-if-env-changed=CC");

    link_c_library(&repo_root);

    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let report = match probe_layout(&header, &include_dir, &out_dir) {
        Ok(report) => report,
        Err(why) => {
            // The library itself does not need the probe; only the layout
            // test does, and it fails with this reason.
            println!("cargo:warning=devbridge: C layout probe unavailable: {}", why);
            format!("unavailable {}\n", why.replace('\n', " "))
        }
    };
    fs::write(out_dir.join("c_layout.txt"), report).expect("write c_layout.txt");
}

fn link_c_library(repo_root: &Path) {
    let lib_dir = match env::var_os(LIB_DIR_VAR) {
        Some(dir) => PathBuf::from(dir),
        None => repo_root.join("build/release/src/c_api"),
    };
    let lib_dir = lib_dir.canonicalize().unwrap_or(lib_dir);
    if !lib_dir.join("libdevbridge_c.so").exists() {
        println!(
            "cargo:warning=devbridge: no libdevbridge_c.so in {} (build the devbridge_c target, or set {})",
            lib_dir.display(),
            LIB_DIR_VAR
        );
    }
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=devbridge_c");
    // This package's tests and examples then run without LD_LIBRARY_PATH.
    // Cargo passes link-arg only to this package's own targets; a crate that
    // depends on this one sets its own rpath (README.md).
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
}

struct CStruct {
    name: String,
    fields: Vec<String>,
}

fn probe_layout(header: &Path, include_dir: &Path, out_dir: &Path) -> Result<String, String> {
    let text = fs::read_to_string(header).map_err(|e| format!("cannot read {}: {}", header.display(), e))?;
    let text = strip_comments(&text);
    let structs = parse_structs(&text);
    let constants = parse_constants(&text);

    let mut program = String::new();
    program.push_str("#include <stdio.h>\n#include <stddef.h>\n#include <devbridge/c/devbridge.h>\n");
    program.push_str("#define FIELD(T, F) printf(\"field %s %s %zu %zu\\n\", #T, #F, offsetof(T, F), sizeof(((T*)0)->F))\n");
    // The header names the version struct only where dlpack.h predates 1.0.
    program.push_str("#if defined(DLPACK_MAJOR_VERSION) && DLPACK_MAJOR_VERSION >= 1\n");
    program.push_str("typedef DLPackVersion devbridge_dlpack_version;\n#endif\n");
    program.push_str("int main(void) {\n");
    for s in &structs {
        program.push_str(&format!("  printf(\"struct %s %zu\\n\", \"{0}\", sizeof({0}));\n", s.name));
        for f in &s.fields {
            program.push_str(&format!("  FIELD({}, {});\n", s.name, f));
        }
    }
    for c in &constants {
        program.push_str(&format!("  printf(\"const %s %lld\\n\", \"{0}\", (long long)({0}));\n", c));
    }
    program.push_str("  return 0;\n}\n");

    let source = out_dir.join("layout_probe.c");
    let binary = out_dir.join("layout_probe");
    fs::write(&source, program).map_err(|e| e.to_string())?;
    let compiler = env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let compiled = Command::new(&compiler)
        .arg("-std=c11")
        .arg("-I")
        .arg(include_dir)
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .output()
        .map_err(|e| format!("cannot run {}: {}", compiler, e))?;
    if !compiled.status.success() {
        return Err(format!("{} failed: {}", compiler, String::from_utf8_lossy(&compiled.stderr)));
    }
    let ran = Command::new(&binary).output().map_err(|e| format!("cannot run the probe: {}", e))?;
    if !ran.status.success() {
        return Err("the probe failed".to_string());
    }
    String::from_utf8(ran.stdout).map_err(|e| e.to_string())
}

fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("/*") {
        out.push_str(&rest[..start]);
        rest = match rest[start..].find("*/") {
            Some(end) => &rest[start + end + 2..],
            None => "",
        };
    }
    out.push_str(rest);
    out
}

// The structs the header itself defines, plus the DLPack ones its structs
// embed. Structs inside a preprocessor conditional are left out: which
// branch compiles depends on the installed dlpack.h.
fn parse_structs(text: &str) -> Vec<CStruct> {
    let mut structs = Vec::new();
    let mut conditional_depth = 0;
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let trimmed = line.trim();
        if trimmed.starts_with("#if") {
            conditional_depth += 1;
        } else if trimmed.starts_with("#endif") {
            conditional_depth -= 1;
        }
        // The include guard is the one conditional every struct sits in.
        if conditional_depth > 1 || !trimmed.starts_with("typedef struct") || !trimmed.ends_with('{') {
            continue;
        }
        let mut body = String::new();
        let mut name = String::new();
        for inner in lines.by_ref() {
            let inner = inner.trim();
            if let Some(tail) = inner.strip_prefix('}') {
                name = tail.trim().trim_end_matches(';').trim().to_string();
                break;
            }
            body.push_str(inner);
            body.push(' ');
        }
        let fields = body.split(';').map(str::trim).filter(|d| !d.is_empty()).map(field_name).collect();
        structs.push(CStruct { name, fields });
    }
    for (name, fields) in [
        ("DLDevice", &["device_type", "device_id"][..]),
        ("DLDataType", &["code", "bits", "lanes"][..]),
        ("DLTensor", &["data", "device", "ndim", "dtype", "shape", "strides", "byte_offset"][..]),
        ("devbridge_dlpack_version", &["major", "minor"][..]),
        ("devbridge_dlpack_tensor", &["version", "manager_ctx", "deleter", "flags", "dl_tensor"][..]),
    ] {
        structs.push(CStruct { name: name.to_string(), fields: fields.iter().map(|f| f.to_string()).collect() });
    }
    structs
}

// `char backend[32]` -> backend; `void (*deleter)(...)` -> deleter.
fn field_name(declaration: &str) -> String {
    if let Some(start) = declaration.find("(*") {
        let rest = &declaration[start + 2..];
        return rest[..rest.find(')').unwrap_or(rest.len())].trim().to_string();
    }
    let without_array = declaration.split('[').next().unwrap_or(declaration);
    without_array
        .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .find(|word| !word.is_empty())
        .unwrap_or("")
        .to_string()
}

fn parse_constants(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.trim().strip_prefix("#define ")?.split_whitespace();
            let name = words.next()?;
            // Function-like macros and the include guard have no value to print.
            if name.contains('(') || words.next().is_none() || !name.starts_with("DEVBRIDGE_") {
                return None;
            }
            Some(name.to_string())
        })
        .collect()
}
