// Checkpoints through the safe crate: a round trip on host and fake, a file
// the Python module reads too (the same format), and refusals that leave
// nothing allocated.
use std::path::PathBuf;

use devbridge::*;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("devbridge-rust-{}-{}", std::process::id(), name));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn upload(bridge: &DeviceBridge, dtype: Dtype, shape: &[u64], seed: u8) -> (DeviceHandle, Vec<u8>) {
    let bytes: Vec<u8> = (0..shape.iter().product::<u64>() * u64::from(dtype.size_bytes()))
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let portable = PortableActivation { shape: shape.to_vec(), dtype, bytes: bytes.clone() };
    (bridge.import_activation(&portable).unwrap(), bytes)
}

fn round_trip_on(backend: &str) {
    let dir = scratch(backend);
    let path = dir.join("model.safetensors");
    let bridge = DeviceBridge::open(backend, None, &OpenOptions::default()).unwrap();
    if backend == "fake" {
        // The fake holds async copies until told; a checkpoint streams
        // through the ring with them.
        bridge.fake_set_auto_complete(true).unwrap();
    }
    let tensors = [("embed.weight", Dtype::Float32, vec![16u64, 8]), ("step", Dtype::Int64, vec![]), ("norm", Dtype::UInt8, vec![3])];
    let mut written = Vec::new();
    for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
        let (handle, bytes) = upload(&bridge, *dtype, shape, i as u8);
        written.push((CheckpointEntry { name: name.to_string(), handle, dtype: *dtype, shape: shape.clone() }, bytes));
    }
    let entries: Vec<CheckpointEntry> = written.iter().map(|(e, _)| e.clone()).collect();
    bridge.checkpoint(&path, &entries, Some(7)).unwrap();

    let live_before = bridge.memory_stats().unwrap().allocated_bytes;
    let restored = bridge.restore(&path).unwrap();
    assert_eq!(restored.generation, 7);
    assert_eq!(restored.tensors.len(), tensors.len());
    for (entry, bytes) in &written {
        let tensor = restored.tensors.iter().find(|t| t.name == entry.name).expect("every tensor comes back");
        assert_eq!((tensor.name.as_str(), tensor.dtype, &tensor.shape), (entry.name.as_str(), entry.dtype, &entry.shape));
        assert_ne!(tensor.handle, entry.handle, "a restore makes new allocations");
        let back = bridge.export_activation(tensor.handle, tensor.dtype, &tensor.shape).unwrap();
        assert_eq!(&back.bytes, bytes, "{} came back different", tensor.name);
        bridge.free_device(tensor.handle).unwrap();
    }
    assert_eq!(bridge.memory_stats().unwrap().allocated_bytes, live_before);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_checkpoint_restores_bit_exact_on_host() {
    round_trip_on("host");
}

#[test]
fn a_checkpoint_restores_bit_exact_on_fake() {
    round_trip_on("fake");
}

#[test]
fn a_corrupt_or_missing_file_is_refused_and_nothing_stays_allocated() {
    let dir = scratch("corrupt");
    let path = dir.join("model.safetensors");
    let bridge = DeviceBridge::open("host", None, &OpenOptions::default()).unwrap();
    let (handle, _) = upload(&bridge, Dtype::Float32, &[1024], 1);
    let entry = CheckpointEntry { name: "w".into(), handle, dtype: Dtype::Float32, shape: vec![1024] };
    bridge.checkpoint(&path, &[entry], None).unwrap();
    bridge.free_device(handle).unwrap();
    let allocated = bridge.memory_stats().unwrap().allocated_bytes;

    // One flipped bit in the data section: the checksum differs.
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let error = bridge.restore(&path).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidRange);
    assert!(error.message().contains("model.safetensors"), "{}", error.message());
    assert_eq!(bridge.memory_stats().unwrap().allocated_bytes, allocated, "a refused restore keeps nothing");

    let missing = bridge.restore(&dir.join("absent.safetensors")).unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::Unavailable);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_name_with_a_nul_byte_or_a_foreign_handle_is_refused_before_writing() {
    let dir = scratch("refusals");
    let path = dir.join("model.safetensors");
    let host = DeviceBridge::open("host", None, &OpenOptions::default()).unwrap();
    let fake = DeviceBridge::open("fake", None, &OpenOptions::default()).unwrap();
    fake.fake_set_auto_complete(true).unwrap();
    let (handle, _) = upload(&host, Dtype::Float32, &[4], 1);
    let nul = CheckpointEntry { name: "a\0b".into(), handle, dtype: Dtype::Float32, shape: vec![4] };
    assert_eq!(host.checkpoint(&path, &[nul], None).unwrap_err().kind(), ErrorKind::InvalidRange);
    let entry = CheckpointEntry { name: "w".into(), handle, dtype: Dtype::Float32, shape: vec![4] };
    assert_eq!(fake.checkpoint(&path, &[entry], None).unwrap_err().kind(), ErrorKind::ForeignDomain);
    assert!(!path.exists(), "a refused checkpoint writes no file");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_subset_restores_only_what_it_names_and_a_checked_subset_is_refused() {
    let dir = scratch("subset");
    let path = dir.join("model.safetensors");
    let bridge = DeviceBridge::open("host", None, &OpenOptions::default()).unwrap();
    let mut entries = Vec::new();
    let mut bytes = Vec::new();
    for (i, name) in ["layers.0.w", "layers.1.w", "head"].iter().enumerate() {
        let (handle, data) = upload(&bridge, Dtype::Float32, &[32], i as u8);
        entries.push(CheckpointEntry { name: name.to_string(), handle, dtype: Dtype::Float32, shape: vec![32] });
        bytes.push(data);
    }
    bridge.checkpoint(&path, &entries, None).unwrap();
    let allocated = bridge.memory_stats().unwrap().allocated_bytes;

    let checked = RestoreSelection { prefix: Some("layers.".into()), ..RestoreSelection::default() };
    let error = bridge.restore_selected(&path, &checked).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidRange);
    assert!(error.message().contains("skip_checksum"), "{}", error.message());
    assert_eq!(bridge.memory_stats().unwrap().allocated_bytes, allocated);

    let layers = bridge.restore_selected(&path, &RestoreSelection { skip_checksum: true, ..checked }).unwrap();
    let mut names: Vec<&str> = layers.tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["layers.0.w", "layers.1.w"]);
    for tensor in &layers.tensors {
        let i = entries.iter().position(|e| e.name == tensor.name).unwrap();
        assert_eq!(bridge.export_activation(tensor.handle, tensor.dtype, &tensor.shape).unwrap().bytes, bytes[i]);
        bridge.free_device(tensor.handle).unwrap();
    }

    let missing = RestoreSelection { names: vec!["nope".into()], skip_checksum: true, ..RestoreSelection::default() };
    let error = bridge.restore_selected(&path, &missing).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::InvalidRange);
    assert!(error.message().contains("nope"), "{}", error.message());
    assert_eq!(bridge.memory_stats().unwrap().allocated_bytes, allocated);
    std::fs::remove_dir_all(dir).unwrap();
}
