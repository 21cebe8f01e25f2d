//! Hostile NDJSON records: the forwarding scanner (the gateway's and the agent's path) and the
//! record-building path must agree on every line: both accept it with the same content hash
//! and partition key, or both reject it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let streams = schemas::example_streams();
    for line in data.split(|b| *b == b'\n') {
        for def in streams.iter() {
            let built = schemas::check_bytes(def, line);
            let forwarded = schemas::check_bytes_forward(def, line);
            match (&built, &forwarded) {
                (Ok(b), Ok(f)) => {
                    assert_eq!(b.hash, f.hash, "{:?}", String::from_utf8_lossy(line));
                    assert_eq!(b.record.partition_key(def), f.key);
                    // The sink's path lands the same record.
                    let row = schemas::check_bytes_row(def, line).expect("the sink's path refused");
                    assert_eq!(row.hash, b.hash);
                }
                (Err(_), Err(_)) => {
                    assert!(schemas::check_bytes_row(def, line).is_err());
                }
                _ => panic!(
                    "paths disagree on {:?}: built {:?}, forwarded {:?}",
                    String::from_utf8_lossy(line),
                    built.as_ref().map(|_| ()),
                    forwarded.as_ref().map(|_| ())
                ),
            }
        }
    }
});
