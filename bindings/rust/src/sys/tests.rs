// src/sys.rs against the header: the C compiler's report (build.rs) for
// layouts and constants, the header's text for the functions it declares.
use std::collections::BTreeMap;

const C_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/c_layout.txt"));
const HEADER: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../include/devbridge/c/devbridge.h"));
const SYS_RS: &str = include_str!("../sys.rs");

struct CReport {
    // struct -> size
    structs: BTreeMap<String, usize>,
    // (struct, field) -> (offset, size)
    fields: BTreeMap<(String, String), (usize, usize)>,
    constants: BTreeMap<String, i64>,
}

fn c_report() -> CReport {
    if let Some(why) = C_REPORT.strip_prefix("unavailable ") {
        panic!("build.rs could not probe the header with the C compiler: {}", why);
    }
    let mut report = CReport { structs: BTreeMap::new(), fields: BTreeMap::new(), constants: BTreeMap::new() };
    for line in C_REPORT.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| words[i].parse::<i64>().unwrap_or_else(|_| panic!("bad probe line {:?}", line));
        match words[0] {
            "struct" => {
                report.structs.insert(words[1].to_string(), number(2) as usize);
            }
            "field" => {
                report
                    .fields
                    .insert((words[1].to_string(), words[2].to_string()), (number(3) as usize, number(4) as usize));
            }
            "const" => {
                report.constants.insert(words[1].to_string(), number(2));
            }
            _ => panic!("unknown probe line {:?}", line),
        }
    }
    report
}

#[test]
fn every_struct_has_the_headers_size_and_field_offsets() {
    let c = c_report();
    let rust = super::rust_layouts();
    let mut problems = Vec::new();
    let mut rust_fields = BTreeMap::new();
    for (name, size, fields) in &rust {
        match c.structs.get(*name) {
            None => problems.push(format!("{} is in sys.rs but not a struct of the header", name)),
            Some(c_size) if c_size != size => problems.push(format!("{}: C size {}, Rust {}", name, c_size, size)),
            Some(_) => {}
        }
        for (field, offset, field_size) in fields {
            rust_fields.insert((name.to_string(), field.to_string()), (*offset, *field_size));
        }
    }
    for name in c.structs.keys() {
        if !rust.iter().any(|(rust_name, _, _)| rust_name == name) {
            problems.push(format!("{} is in the header but not in sys.rs", name));
        }
    }
    for (key, c_layout) in &c.fields {
        match rust_fields.get(key) {
            None => problems.push(format!("{}.{} is in the header but not in sys.rs", key.0, key.1)),
            Some(rust_layout) if rust_layout != c_layout => problems.push(format!(
                "{}.{}: C (offset, size) {:?}, Rust {:?}",
                key.0, key.1, c_layout, rust_layout
            )),
            Some(_) => {}
        }
    }
    for key in rust_fields.keys() {
        if c.structs.contains_key(&key.0) && !c.fields.contains_key(key) {
            problems.push(format!("{}.{} is in sys.rs but not in the header", key.0, key.1));
        }
    }
    assert!(problems.is_empty(), "sys.rs disagrees with the header:\n{}", problems.join("\n"));
    assert!(c.structs.len() >= 20, "the probe found only {} structs; is build.rs's parser broken?", c.structs.len());
}

#[test]
fn every_constant_has_the_headers_value() {
    let c = c_report();
    let rust: BTreeMap<&str, i64> = super::rust_constants().into_iter().collect();
    let mut problems = Vec::new();
    for (name, value) in &c.constants {
        match rust.get(name.as_str()) {
            None => problems.push(format!("{} = {} is in the header but not in sys.rs", name, value)),
            Some(rust_value) if rust_value != value => {
                problems.push(format!("{}: C {}, Rust {}", name, value, rust_value))
            }
            Some(_) => {}
        }
    }
    for name in rust.keys() {
        if !c.constants.contains_key(*name) {
            problems.push(format!("{} is in sys.rs but not in the header", name));
        }
    }
    assert!(problems.is_empty(), "sys.rs disagrees with the header:\n{}", problems.join("\n"));
}

// Names followed by '(' in the header once comments are gone: the declared
// functions (a function-pointer typedef's name is followed by ')').
fn declared_functions(text: &str) -> Vec<String> {
    let mut code = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("/*") {
        code.push_str(&rest[..start]);
        rest = rest[start..].find("*/").map_or("", |end| &rest[start + end + 2..]);
    }
    code.push_str(rest);
    let bytes = code.as_bytes();
    let is_word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut names = Vec::new();
    let mut i = 0;
    while let Some(found) = code[i..].find("devbridge_") {
        let start = i + found;
        let mut end = start;
        while end < bytes.len() && is_word(bytes[end]) {
            end += 1;
        }
        let preceded_by_word = start > 0 && is_word(bytes[start - 1]);
        let next = code[end..].trim_start().chars().next();
        if !preceded_by_word && next == Some('(') {
            names.push(code[start..end].to_string());
        }
        i = end;
    }
    names.sort();
    names.dedup();
    names
}

#[test]
fn every_header_function_is_declared_in_sys_rs_and_no_other() {
    let header = declared_functions(HEADER);
    assert!(header.len() >= 50, "found only {} functions in the header", header.len());
    let missing: Vec<&String> =
        header.iter().filter(|name| !SYS_RS.contains(&format!("pub fn {}(", name))).collect();
    assert!(missing.is_empty(), "declared in the header, missing from sys.rs: {:?}", missing);
    let extra: Vec<&str> = SYS_RS
        .split("pub fn ")
        .skip(1)
        .map(|tail| &tail[..tail.find('(').unwrap_or(0)])
        .filter(|name| name.starts_with("devbridge_") && !header.iter().any(|h| h == name))
        .collect();
    assert!(extra.is_empty(), "declared in sys.rs but not in the header: {:?}", extra);
}

#[test]
fn the_library_speaks_the_abi_major_this_crate_was_written_for() {
    let version = unsafe { super::devbridge_abi_version() };
    assert_eq!(version >> 16, super::DEVBRIDGE_ABI_VERSION_MAJOR);
    assert!(version & 0xffff >= super::DEVBRIDGE_ABI_VERSION_MINOR);
}
