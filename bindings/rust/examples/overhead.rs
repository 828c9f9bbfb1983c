//! What the safe wrapper costs over calling the C ABI directly: workload a
//! (allocate and free) and c (a synchronous upload of a ring range) on one
//! host bridge, each timed through `DeviceBridge` and through `sys` in the
//! same process, rounds alternating, medians side by side. `make bench` runs
//! it (scripts/bench.sh); nothing here asserts a time.
use std::time::Instant;

use devbridge::{sys, CopyMode, DeviceBridge, DeviceRange, ObjectSpec, OpenOptions, ShapeKind};

const ITERATIONS: u32 = 200_000;
const ROUNDS: usize = 5;
const BYTES: u64 = 4096;

fn ok(status: sys::devbridge_status) {
    assert_eq!(status, sys::DEVBRIDGE_OK, "a C call failed");
}

fn spec() -> ObjectSpec {
    ObjectSpec { max_extent: BYTES, alignment: 64, dtype: None, shape: ShapeKind::Vector }
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

fn main() {
    let bridge = DeviceBridge::open("host", None, &OpenOptions::default()).expect("open host");
    let raw = bridge.as_raw();
    let c_spec = {
        let mut spec: sys::devbridge_object_spec = sys::sized();
        spec.max_extent = BYTES;
        spec.alignment = 64;
        spec.dtype = sys::DEVBRIDGE_DTYPE_BYTES;
        spec.shape = sys::DEVBRIDGE_SHAPE_VECTOR;
        spec
    };
    let rust_spec = spec();

    let mut alloc_free_rust = || {
        let handle = bridge.alloc_device(&rust_spec, BYTES).unwrap();
        bridge.free_device(handle).unwrap();
    };
    let mut alloc_free_c = || unsafe {
        let mut handle = sys::devbridge_handle { domain: 0, generation: 0, id: 0 };
        ok(sys::devbridge_alloc_device(raw, &c_spec, BYTES, &mut handle));
        ok(sys::devbridge_free_device(raw, handle));
    };

    let target = bridge.alloc_device(&rust_spec, BYTES).unwrap();
    let mut reservation = bridge.reserve_host(BYTES, 0, None).unwrap();
    let whole = DeviceRange { handle: target, offset: 0, len: BYTES };
    // The same ring range and allocation for the C side: only the wrapper
    // differs (other addresses would change memcpy's speed, not the call's).
    let c_ring = {
        let range = reservation.range();
        sys::devbridge_host_range { offset: range.offset, len: range.len }
    };
    let c_target = sys::devbridge_device_range {
        handle: sys::devbridge_handle { domain: target.domain(), generation: target.generation(), id: target.id() },
        offset: 0,
        len: BYTES,
    };
    let mut upload_rust = || {
        bridge.host_to_device(reservation.span(0, BYTES).unwrap(), whole, CopyMode::Sync).unwrap();
    };
    let mut upload_c = || unsafe {
        let mut event = sys::devbridge_event { domain: 0, generation: 0, id: 0 };
        ok(sys::devbridge_host_to_device(raw, c_ring, c_target, sys::DEVBRIDGE_COPY_SYNC, &mut event));
    };

    println!("{:<24} {:>10} {:>10} {:>10}", "workload (host)", "Rust ns", "C ns", "Rust - C");
    let run = |name: &str, rust: &mut dyn FnMut(), c: &mut dyn FnMut()| {
        ns_per_op(ITERATIONS / 10, rust); // warm-up, both sides
        ns_per_op(ITERATIONS / 10, c);
        let (mut rust_ns, mut c_ns) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            // Swapped order each round, so drift favours neither side.
            if round % 2 == 0 {
                rust_ns.push(ns_per_op(ITERATIONS, rust));
                c_ns.push(ns_per_op(ITERATIONS, c));
            } else {
                c_ns.push(ns_per_op(ITERATIONS, c));
                rust_ns.push(ns_per_op(ITERATIONS, rust));
            }
        }
        let differences = rust_ns.iter().zip(&c_ns).map(|(r, c)| r - c).collect();
        println!(
            "{:<24} {:>10.1} {:>10.1} {:>+10.1}",
            name,
            median(rust_ns),
            median(c_ns),
            median(differences)
        );
    };
    run("a alloc+free", &mut alloc_free_rust, &mut alloc_free_c);
    run("c sync upload 4 KiB", &mut upload_rust, &mut upload_c);
}
