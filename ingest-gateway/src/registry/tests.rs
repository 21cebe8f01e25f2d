//! The registry API as serializers call it, on the shipped definitions (no broker).

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::json;

use crate::config::LimitsConfig;
use crate::tests::{TOKEN, app, call};

const SUBJECT: &str = "ingest.sensor_readings-value";

fn get(path: &str, authorization: Option<String>) -> Request<Body> {
    let mut r = Request::get(path);
    if let Some(a) = authorization {
        r = r.header("authorization", a);
    }
    r.body(Body::empty()).unwrap()
}

fn post(path: &str, body: serde_json::Value) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/vnd.schemaregistry.v1+json")
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Body::from(body.to_string()))
        .unwrap()
}

fn bearer() -> Option<String> {
    Some(format!("Bearer {TOKEN}"))
}

#[tokio::test]
async fn a_streams_definition_is_its_subjects_first_version() {
    let app = app(LimitsConfig::default());
    let (status, subjects) = call(app.clone(), get("/registry/subjects", bearer())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        subjects,
        json!([SUBJECT, "ingest.vehicle_telemetry-value"]),
        "every stream is a subject"
    );
    let path = format!("/registry/subjects/{SUBJECT}/versions/latest");
    let (status, latest) = call(app.clone(), get(&path, bearer())).await;
    assert_eq!(status, StatusCode::OK, "{latest}");
    assert_eq!(latest["version"], 1);
    assert_eq!(latest["subject"], SUBJECT);
    let schema: serde_json::Value =
        serde_json::from_str(latest["schema"].as_str().unwrap()).unwrap();
    assert_eq!(schema["type"], "record");
    assert_eq!(schema["name"], "sensor_readings");
    let id = latest["id"].as_u64().unwrap();
    let (status, by_id) = call(
        app.clone(),
        get(&format!("/registry/schemas/ids/{id}"), bearer()),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(by_id["schema"], latest["schema"]);
    assert!(
        by_id.get("schemaType").is_none(),
        "Avro is the default type"
    );
    // Registering the definition's own schema gives its id back.
    let (status, registered) = call(
        app.clone(),
        post(
            &format!("/registry/subjects/{SUBJECT}/versions"),
            json!({"schema": latest["schema"]}),
        ),
    )
    .await;
    assert_eq!((status, registered), (StatusCode::OK, json!({"id": id})));
    let (status, versions) = call(
        app,
        get(&format!("/registry/subjects/{SUBJECT}/versions"), bearer()),
    )
    .await;
    assert_eq!((status, versions), (StatusCode::OK, json!([1])));
}

#[tokio::test]
async fn schemas_the_definition_takes_are_registered_and_others_refused() {
    let app = app(LimitsConfig::default());
    let versions = format!("/registry/subjects/{SUBJECT}/versions");
    // A producer's own schema: fewer optional fields, a float value, millisecond timestamps.
    let own = json!({"type": "record", "name": "Reading", "fields": [
        {"name": "device_id", "type": "string"},
        {"name": "sensor", "type": "string"},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "value", "type": "float"}]});
    let (status, answer) = call(
        app.clone(),
        post(&versions, json!({"schema": own.to_string()})),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let id = answer["id"].as_u64().unwrap();
    let (_, listed) = call(app.clone(), get(&versions, bearer())).await;
    assert_eq!(listed, json!([1, 2]));
    let (_, by_id) = call(
        app.clone(),
        get(&format!("/registry/schemas/ids/{id}"), bearer()),
    )
    .await;
    assert_eq!(by_id["schema"], own.to_string());
    let (status, found) = call(
        app.clone(),
        post(
            &format!("/registry/subjects/{SUBJECT}"),
            json!({"schema": own.to_string()}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (found["id"].as_u64(), found["version"].as_u64()),
        (Some(id), Some(2))
    );

    let wrong_type = json!({"type": "record", "name": "Reading", "fields": [
        {"name": "device_id", "type": "string"}, {"name": "sensor", "type": "string"},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "value", "type": "string"}]});
    let (status, refused) = call(
        app.clone(),
        post(&versions, json!({"schema": wrong_type.to_string()})),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT, "{refused}");
    assert_eq!(refused["error_code"], 409);
    assert!(
        refused["message"]
            .as_str()
            .unwrap()
            .contains("'value' is string"),
        "{refused}"
    );
    let compatibility = format!("/registry/compatibility/subjects/{SUBJECT}/versions/latest");
    let (status, checked) = call(
        app.clone(),
        post(&compatibility, json!({"schema": wrong_type.to_string()})),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(checked["is_compatible"], false);
    let (_, checked) = call(
        app.clone(),
        post(&compatibility, json!({"schema": own.to_string()})),
    )
    .await;
    assert_eq!(checked["is_compatible"], true);
    let (status, invalid) = call(app.clone(), post(&versions, json!({"schema": "{"}))).await;
    assert_eq!(
        (status, invalid["error_code"].clone()),
        (StatusCode::UNPROCESSABLE_ENTITY, json!(42201))
    );
    // The vehicle stream takes JSON values only: an Avro schema for it is refused.
    let vehicles = "/registry/subjects/ingest.vehicle_telemetry-value/versions";
    let (status, refused) = call(app, post(vehicles, json!({"schema": own.to_string()}))).await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "the token may not write it: {refused}"
    );
}

#[tokio::test]
async fn callers_are_the_gateways_tokens_as_bearer_or_basic_credentials() {
    use base64::Engine as _;
    let app = app(LimitsConfig::default());
    let (status, refused) = call(app.clone(), get("/registry/subjects", None)).await;
    assert_eq!(
        (status, refused["error_code"].clone()),
        (StatusCode::UNAUTHORIZED, json!(40101))
    );
    let wrong = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode("sensors:not-the-token")
    );
    let (status, _) = call(app.clone(), get("/registry/subjects", Some(wrong))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("sensors:{TOKEN}"))
    );
    let (status, _) = call(app.clone(), get("/registry/subjects", Some(basic))).await;
    assert_eq!(status, StatusCode::OK);
    for (path, code) in [
        ("/registry/subjects/ingest.nothing-value/versions", 40401),
        (&*format!("/registry/subjects/{SUBJECT}/versions/9"), 40402),
        ("/registry/schemas/ids/12345", 40403),
    ] {
        let (status, answer) = call(app.clone(), get(path, bearer())).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(answer["error_code"], code, "{path}");
    }
    let (status, config) = call(app, get("/registry/config", bearer())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(config["compatibilityLevel"], "BACKWARD");
}
