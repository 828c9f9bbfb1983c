//! What the safe wrapper costs over calling the C ABI directly: workload a
//! (allocate and free) and c (a synchronous upload of a ring range) on one
//! host bridge, each timed through `DeviceBridge` and through `sys` in the
//! same process, rounds alternating, medians side by side. Each workload also
//! gets an A/A row (the C calls against themselves, two copies of the same
//! loop): the difference a run shows where there is none, to read the
//! wrapper's figure against. `make bench` runs it (scripts/bench.sh);
//! nothing here asserts a time.
//!
//! `OVERHEAD_ONLY=<rust|c>-<a|c> OVERHEAD_N=<n>` runs only that loop n times,
//! for callgrind's instruction counts (the slope between two n; DECISIONS.md).
use std::time::Instant;

use devbridge::{sys, CopyMode, DeviceBridge, DeviceRange, ObjectSpec, OpenOptions, ShapeKind};

const ITERATIONS: u32 = 200_000;
const ROUNDS: usize = 5;
const BYTES: u64 = 4096;

fn ok(status: sys::devbridge_status) {
    assert_eq!(status, sys::DEVBRIDGE_OK, "a C call failed");
}

fn ns_per_op(iterations: u32, body: &mut dyn FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..iterations {
        body();
    }
    start.elapsed().as_nanos() as f64 / f64::from(iterations)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

/// Medians of `ROUNDS` rounds of each side, the order swapped every round
/// so drift favours neither, and the median of the per-round differences.
fn compare(name: &str, first: &mut dyn FnMut(), second: &mut dyn FnMut()) {
    ns_per_op(ITERATIONS / 10, first); // warm-up, both sides
    ns_per_op(ITERATIONS / 10, second);
    let (mut first_ns, mut second_ns) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        if round % 2 == 0 {
            first_ns.push(ns_per_op(ITERATIONS, first));
            second_ns.push(ns_per_op(ITERATIONS, second));
        } else {
            second_ns.push(ns_per_op(ITERATIONS, second));
            first_ns.push(ns_per_op(ITERATIONS, first));
        }
    }
    let differences = first_ns.iter().zip(&second_ns).map(|(a, b)| a - b).collect();
    println!("{:<30} {:>9.1} {:>9.1} {:>+9.1}", name, median(first_ns), median(second_ns), median(differences));
}

unsafe fn c_alloc_free(raw: *mut sys::devbridge_bridge, spec: &sys::devbridge_object_spec) {
    let mut handle = sys::devbridge_handle { domain: 0, generation: 0, id: 0 };
    ok(sys::devbridge_alloc_device(raw, spec, BYTES, &mut handle));
    ok(sys::devbridge_free_device(raw, handle));
}

unsafe fn c_upload(raw: *mut sys::devbridge_bridge, ring: sys::devbridge_host_range, target: sys::devbridge_device_range) {
    let mut event = sys::devbridge_event { domain: 0, generation: 0, id: 0 };
    ok(sys::devbridge_host_to_device(raw, ring, target, sys::DEVBRIDGE_COPY_SYNC, &mut event));
}

fn main() {
    let bridge = DeviceBridge::open("host", None, &OpenOptions::default()).expect("open host");
    let raw = bridge.as_raw();
    let rust_spec = ObjectSpec { max_extent: BYTES, alignment: 64, dtype: None, shape: ShapeKind::Vector };
    let c_spec = {
        let mut spec: sys::devbridge_object_spec = sys::sized();
        spec.max_extent = BYTES;
        spec.alignment = 64;
        spec.dtype = sys::DEVBRIDGE_DTYPE_BYTES;
        spec.shape = sys::DEVBRIDGE_SHAPE_VECTOR;
        spec
    };

    let target = bridge.alloc_device(&rust_spec, BYTES).unwrap();
    let mut reservation = bridge.reserve_host(BYTES, 0, None).unwrap();
    let whole = DeviceRange { handle: target, offset: 0, len: BYTES };
    // The same ring range and allocation for the C side: only the wrapper
    // differs (other addresses would change memcpy's speed, not the call's).
    let c_ring = sys::devbridge_host_range { offset: reservation.range().offset, len: BYTES };
    let c_target = sys::devbridge_device_range {
        handle: sys::devbridge_handle { domain: target.domain(), generation: target.generation(), id: target.id() },
        offset: 0,
        len: BYTES,
    };

    let mut alloc_free_rust = || {
        let handle = bridge.alloc_device(&rust_spec, BYTES).unwrap();
        bridge.free_device(handle).unwrap();
    };
    let mut alloc_free_c = || unsafe { c_alloc_free(raw, &c_spec) };
    let mut alloc_free_c_again = || unsafe { c_alloc_free(raw, &c_spec) };
    let mut upload_rust = || {
        bridge.host_to_device(reservation.span(0, BYTES).unwrap(), whole, CopyMode::Sync).unwrap();
    };
    let mut upload_c = || unsafe { c_upload(raw, c_ring, c_target) };
    let mut upload_c_again = || unsafe { c_upload(raw, c_ring, c_target) };

    if let Ok(only) = std::env::var("OVERHEAD_ONLY") {
        let n: u32 = std::env::var("OVERHEAD_N").ok().and_then(|v| v.parse().ok()).unwrap_or(ITERATIONS);
        let body: &mut dyn FnMut() = match only.as_str() {
            "rust-a" => &mut alloc_free_rust,
            "c-a" => &mut alloc_free_c,
            "rust-c" => &mut upload_rust,
            "c-c" => &mut upload_c,
            _ => panic!("OVERHEAD_ONLY is one of rust-a, c-a, rust-c, c-c"),
        };
        println!("{:.1} ns/op", ns_per_op(n, body));
        return;
    }

    println!("{:<30} {:>9} {:>9} {:>9}", "workload (host), ns per op", "first", "second", "diff");
    compare("a alloc+free: Rust | C", &mut alloc_free_rust, &mut alloc_free_c);
    compare("a alloc+free: C | C (A/A)", &mut alloc_free_c_again, &mut alloc_free_c);
    compare("c sync upload 4 KiB: Rust | C", &mut upload_rust, &mut upload_c);
    compare("c sync upload: C | C (A/A)", &mut upload_c_again, &mut upload_c);
}
