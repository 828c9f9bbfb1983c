// The host backend end to end, and the executor-style surface.
use std::time::Duration;

use devbridge::*;

#[test]
fn host_backend_round_trip() {
    const ELEMENTS: usize = 1024;
    const BYTES: u64 = (ELEMENTS * 4) as u64;
    let bridge = DeviceBridge::open("host", None, &OpenOptions { ring_bytes: 1 << 20, ..OpenOptions::default() })
        .expect("the host backend runs everywhere");
    let info = bridge.backend_info().unwrap();
    assert_eq!(info.backend, "host");
    assert!(info.host_addressable);

    let spec = ObjectSpec { max_extent: BYTES, alignment: 64, dtype: Some(Dtype::Float32), shape: ShapeKind::Matrix };
    let handle = bridge.alloc_device(&spec, BYTES).unwrap();
    let values: Vec<f32> = (0..ELEMENTS).map(|i| i as f32 * 0.5 - 3.0).collect();

    // Reserve, fill, upload async, wait, safe to release, release.
    let mut upload_bytes = bridge.reserve_host(BYTES, 0, Some(Duration::from_secs(1))).unwrap();
    for (chunk, value) in upload_bytes.bytes_mut().unwrap().chunks_exact_mut(4).zip(&values) {
        chunk.copy_from_slice(&value.to_le_bytes());
    }
    let device = DeviceRange { handle, offset: 0, len: BYTES };
    let upload = bridge.host_to_device(upload_bytes.whole(), device, CopyMode::Async).unwrap();
    assert_eq!(bridge.wait(upload, Some(Duration::from_secs(10))).unwrap(), CopyOutcome::Completed);
    assert!(bridge.safe_to_release_host(upload).unwrap());
    upload_bytes.release().map_err(|(e, _)| e).unwrap();

    // A view over the allocation: host memory the CPU reads at its address.
    let view = bridge.wrap_for_tinygrad(handle, &ViewSpec::contiguous(Dtype::Float32, &[32, 32])).unwrap();
    assert_eq!(view.shape(), &[32, 32]);
    assert_eq!(view.strides(), &[32, 1]);
    assert_eq!(view.tinygrad_device(), info.tinygrad_device);
    assert_eq!(view.device().device_type, 1, "kDLCPU");
    // SAFETY: host_addressable; the lease keeps ELEMENTS floats there and no
    // copy is in flight.
    let seen = unsafe { std::slice::from_raw_parts(view.data_ptr() as *const f32, ELEMENTS) };
    assert_eq!(seen, &values[..]);
    drop(view);

    // Download and verify.
    let mut download_bytes = bridge.reserve_host(BYTES, 0, None).unwrap();
    let download = bridge.device_to_host(device, download_bytes.whole(), CopyMode::Async).unwrap();
    assert_eq!(bridge.wait(download, None).unwrap(), CopyOutcome::Completed);
    assert!(bridge.host_bytes_valid(download).unwrap());
    let downloaded: Vec<f32> = download_bytes
        .bytes()
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(downloaded, values);
    download_bytes.release().map_err(|(e, _)| e).unwrap();

    bridge.free_device(handle).unwrap();
    let memory = bridge.memory_stats().unwrap();
    assert_eq!(memory.allocated_bytes, 0);
    assert!(memory.peak_allocated_bytes >= BYTES);
    let stats = bridge.stats().unwrap();
    assert_eq!((stats.live_allocations, stats.ring_reservations, stats.live_views), (0, 0, 0));
}

#[test]
fn a_view_outlives_its_bridge() {
    let bridge = DeviceBridge::open("host", None, &OpenOptions::default()).unwrap();
    let spec = ObjectSpec { max_extent: 256, alignment: 4, dtype: Some(Dtype::Int32), shape: ShapeKind::Vector };
    let handle = bridge.alloc_device(&spec, 256).unwrap();
    let view = bridge.wrap_for_tinygrad(handle, &ViewSpec::contiguous(Dtype::Int32, &[64])).unwrap();
    drop(bridge);
    // The C ABI keeps a live view's memory past destroy.
    let seen = unsafe { std::slice::from_raw_parts(view.data_ptr() as *const i32, 64) };
    assert_eq!(seen.len(), 64);
    view.end().unwrap();
}

#[test]
fn devices_are_listed_with_their_identity() {
    for backend in ["fake", "host"] {
        let devices = DeviceBridge::list_devices(backend).unwrap();
        assert!(!devices.is_empty(), "{} lists no device", backend);
        let bridge = DeviceBridge::open(backend, Some(&devices[0].device_id), &OpenOptions::default()).unwrap();
        let bound = bridge.backend_info().unwrap();
        // Free memory moves between the two reads.
        assert_eq!((&bound.device_id, &bound.pci_bus_id, &bound.device_name), (&devices[0].device_id, &devices[0].pci_bus_id, &devices[0].device_name));
    }
    assert_eq!(DeviceBridge::list_devices("nonsense").unwrap_err().kind(), ErrorKind::Unavailable);
}

#[test]
fn the_executor_surface() {
    let bridge = DeviceBridge::open("fake", None, &OpenOptions::default()).unwrap();
    bridge.fake_set_auto_complete(true).unwrap();
    assert_eq!(bridge.vendor().unwrap(), Vendor::Cpu);
    let devices = bridge.devices().unwrap();
    assert_eq!(devices.len(), 1);
    let info = bridge.backend_info().unwrap();
    assert_eq!(devices[0].bus_address, info.pci_bus_id);
    assert_eq!(devices[0].display_name, info.device_name);
    let dtypes = bridge.supported_dtypes().unwrap();
    assert!(dtypes.contains(&Dtype::Float32), "{:?}", dtypes);

    let activation = bridge.alloc_activation(&[2, 3, 4], Dtype::Float32).unwrap();
    assert_eq!(bridge.extent(activation).unwrap(), 2 * 3 * 4 * 4);
    bridge.release_activation(activation).unwrap();
    bridge.release_activation(activation).unwrap(); // idempotent
    let overflow = bridge.alloc_activation(&[u64::MAX, 2], Dtype::Float32).unwrap_err();
    assert_eq!(overflow.kind(), ErrorKind::InvalidExtent);

    let other = DeviceBridge::open("fake", None, &OpenOptions::default()).unwrap();
    let theirs = other.alloc_activation(&[4], Dtype::Float32).unwrap();
    assert_eq!(bridge.release_activation(theirs).unwrap_err().kind(), ErrorKind::ForeignDomain);
}

#[test]
fn activations_cross_bridges_in_portable_form() {
    let producer = DeviceBridge::open("fake", None, &OpenOptions { ring_bytes: 4096, ..OpenOptions::default() }).unwrap();
    producer.fake_set_auto_complete(true).unwrap();
    let consumer = DeviceBridge::open("host", None, &OpenOptions { ring_bytes: 4096, ..OpenOptions::default() }).unwrap();

    // Larger than either ring: staged in chunks.
    let shape = [16u64, 1024];
    let values: Vec<u8> = (0..16 * 1024 * 4).map(|i| (i % 251) as u8).collect();
    let portable = PortableActivation { shape: shape.to_vec(), dtype: Dtype::Float32, bytes: values.clone() };
    let on_producer = producer.import_activation(&portable).unwrap();
    let exported = producer.export_activation(on_producer, Dtype::Float32, &shape).unwrap();
    assert_eq!(exported, portable);

    // A dim past i64 is the C layer's bad dim (InvalidRange), as bytes that overflow are.
    let past_i64 = producer.export_activation(on_producer, Dtype::Float32, &[u64::MAX]).unwrap_err();
    assert_eq!(past_i64.kind(), ErrorKind::InvalidRange, "{}", past_i64);
    let overflowing = producer.export_activation(on_producer, Dtype::Float32, &[1u64 << 62]).unwrap_err();
    assert_eq!(overflowing.kind(), ErrorKind::InvalidRange, "{}", overflowing);

    let on_consumer = consumer.import_activation(&exported).unwrap();
    let back = consumer.export_activation(on_consumer, Dtype::Float32, &shape).unwrap();
    assert_eq!(back.bytes, values);
    consumer.release_activation(on_consumer).unwrap();
    producer.release_activation(on_producer).unwrap();

    let empty = PortableActivation { shape: vec![0], dtype: Dtype::Float32, bytes: Vec::new() };
    assert_eq!(consumer.import_activation(&empty).unwrap_err().kind(), ErrorKind::InvalidExtent);
}
